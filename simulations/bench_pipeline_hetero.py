"""``python -m simulations.bench_pipeline_hetero``, the name the docs and the results quote: runs
:mod:`simulations.benchmarks.pipeline_hetero`."""

from simulations import forward

forward("simulations.benchmarks.pipeline_hetero", __name__)
