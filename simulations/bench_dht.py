"""``python -m simulations.bench_dht``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.dht`."""

from simulations import forward

forward("simulations.benchmarks.dht", __name__)
