"""``python -m simulations.large_models``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.large_models`."""

from simulations import forward

forward("simulations.benchmarks.large_models", __name__)
