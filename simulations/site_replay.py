"""``python -m simulations.site_replay``: runs :mod:`simulations.benchmarks.site_replay`."""

from simulations import forward

forward("simulations.benchmarks.site_replay", __name__)
