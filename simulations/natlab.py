"""``python -m simulations.natlab``, the name the README and the results quote: runs
:mod:`simulations.labs.natlab`."""

from simulations import forward

forward("simulations.labs.natlab", __name__)
