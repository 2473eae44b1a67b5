"""``python -m simulations.bench_pipeline_procs``, the name the docs and the results quote: runs
:mod:`simulations.benchmarks.pipeline_procs`."""

from simulations import forward

forward("simulations.benchmarks.pipeline_procs", __name__)
