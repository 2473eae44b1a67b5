"""``python -m simulations.bench_training``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.training`."""

from simulations import forward

forward("simulations.benchmarks.training", __name__)
