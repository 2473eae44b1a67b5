"""``python -m simulations.fetch_probe``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.fetch_probe`."""

from simulations import forward

forward("simulations.benchmarks.fetch_probe", __name__)
