"""``python -m simulations.bench_sharded``: runs :mod:`simulations.benchmarks.sharded`."""

from simulations import forward

forward("simulations.benchmarks.sharded", __name__)
