"""``python -m simulations.bench_pipeline_churn``, the name the docs and the results quote: runs
:mod:`simulations.benchmarks.pipeline_churn`."""

from simulations import forward

forward("simulations.benchmarks.pipeline_churn", __name__)
