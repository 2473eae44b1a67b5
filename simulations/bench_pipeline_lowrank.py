"""``python -m simulations.bench_pipeline_lowrank``, the name the docs and the results quote: runs
:mod:`simulations.benchmarks.pipeline_lowrank`."""

from simulations import forward

forward("simulations.benchmarks.pipeline_lowrank", __name__)
