"""``python -m simulations.bench_allreduce``, the name the README and the results quote: runs
:mod:`simulations.benchmarks.allreduce`."""

from simulations import forward

forward("simulations.benchmarks.allreduce", __name__)
