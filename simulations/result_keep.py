"""``python -m simulations.result_keep``: runs :mod:`simulations.benchmarks.result_keep`."""

from simulations import forward

forward("simulations.benchmarks.result_keep", __name__)
