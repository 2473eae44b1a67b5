"""``python -m simulations.bench_pipeline``, the name the docs and the results quote: runs
:mod:`simulations.benchmarks.pipeline`."""

from simulations import forward

forward("simulations.benchmarks.pipeline", __name__)
