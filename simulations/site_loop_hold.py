"""``python -m simulations.site_loop_hold``: runs :mod:`simulations.benchmarks.site_loop_hold`."""

from simulations import forward

forward("simulations.benchmarks.site_loop_hold", __name__)
