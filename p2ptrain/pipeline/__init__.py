"""Pipelines over the swarm: a model split into stages served by different peers (docs/pipeline.md).

Modules, one concept each: ``settings`` (the ``[pipeline]`` run-file section), ``stages`` (the built-in
GPT split by layer), ``codec`` (activations on the wire and their checks), ``protocol`` (the RPCs and
the directory record), ``server`` (a stage server), ``directory`` (who serves which stage, in the DHT),
``router`` (a caller's micro-batches through one peer per stage), ``stagewise`` (a stage's peers
average with the existing all-reduce), ``peer`` (all of it around a node).
"""

from .settings import PipelineSection

__all__ = ["PipelineSection"]
