"""``python -m simulations.bench_transport``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.transport`."""

from simulations import forward

forward("simulations.benchmarks.transport", __name__)
