"""``python -m simulations.bench_bytes``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.bytes_per_token`."""

from simulations import forward

forward("simulations.benchmarks.bytes_per_token", __name__)
