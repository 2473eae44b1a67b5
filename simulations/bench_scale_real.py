"""``python -m simulations.bench_scale_real``: runs :mod:`simulations.benchmarks.scale_real`."""

from simulations import forward

forward("simulations.benchmarks.scale_real", __name__)
