"""``python -m simulations.bench_sharded_join``: runs :mod:`simulations.benchmarks.sharded_join`."""

from simulations import forward

forward("simulations.benchmarks.sharded_join", __name__)
