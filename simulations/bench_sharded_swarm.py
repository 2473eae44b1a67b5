"""``python -m simulations.bench_sharded_swarm``: runs :mod:`simulations.benchmarks.sharded_swarm`."""

from simulations import forward

forward("simulations.benchmarks.sharded_swarm", __name__)
