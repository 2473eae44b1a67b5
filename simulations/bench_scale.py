"""``python -m simulations.bench_scale``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.scale`."""

from simulations import forward

forward("simulations.benchmarks.scale", __name__)
