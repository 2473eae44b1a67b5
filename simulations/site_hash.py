"""``python -m simulations.site_hash``: runs :mod:`simulations.benchmarks.site_hash`."""

from simulations import forward

forward("simulations.benchmarks.site_hash", __name__)
