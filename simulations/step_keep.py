"""``python -m simulations.step_keep``: runs :mod:`simulations.benchmarks.step_keep`."""

from simulations import forward

forward("simulations.benchmarks.step_keep", __name__)
