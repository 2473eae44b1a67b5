"""``python -m simulations.bench_statesync``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.statesync`."""

from simulations import forward

forward("simulations.benchmarks.statesync", __name__)
