"""The training loop a node runs, and what it reports to.

- :mod:`.trainer`: ``Trainer``: the task's model and data, the collaborative optimizer, evaluation,
  checkpoints, metrics, draining on stop.
- :mod:`.console`: what a person watching sees: one node's panel, the table of a local swarm.
- :mod:`.trackers`: the per-step metrics sent to TensorBoard or MLflow as well, when asked.
- :mod:`.data_swarm`: which swarm the task's data is shared with, set by the trainer for the threads
  that read the data.
"""
