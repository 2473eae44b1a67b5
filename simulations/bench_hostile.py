"""``python -m simulations.bench_hostile``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.hostile`."""

from simulations import forward

forward("simulations.benchmarks.hostile", __name__)
