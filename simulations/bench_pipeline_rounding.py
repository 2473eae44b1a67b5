"""``python -m simulations.bench_pipeline_rounding``, the name the docs and the results quote: runs
:mod:`simulations.benchmarks.pipeline_rounding`."""

from simulations import forward

forward("simulations.benchmarks.pipeline_rounding", __name__)
