"""``python -m simulations.site_build``: runs :mod:`simulations.benchmarks.site_build`."""

from simulations import forward

forward("simulations.benchmarks.site_build", __name__)
