"""``python -m simulations.bench_connflood``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.connflood`."""

from simulations import forward

forward("simulations.benchmarks.connflood", __name__)
