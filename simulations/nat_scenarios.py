"""``python -m simulations.nat_scenarios``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.nat_training`."""

from simulations import forward

forward("simulations.benchmarks.nat_training", __name__)
