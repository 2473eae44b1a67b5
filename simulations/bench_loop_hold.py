"""``python -m simulations.bench_loop_hold``: runs :mod:`simulations.benchmarks.loop_hold`."""

from simulations import forward

forward("simulations.benchmarks.loop_hold", __name__)
