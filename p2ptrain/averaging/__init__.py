"""Averaging: matchmaking, bandwidth-weighted partitions, the butterfly all-reduce and compression.

Map of the package (pure modules take messages and ``now`` and return decisions with their reasons):

- the node's service: ``averager`` (``Averager``: one per node, dispatches every round's calls),
  ``settings`` (``AveragerConfig``), ``grouping`` (forming a group over the DHT; its pure rules are
  ``matchmaking`` and ``rules``, the partition shares ``partition`` and ``bandwidth``);
- one round: ``allreduce`` (the trio driver), ``round_machine`` (its decisions: who failed, the plan
  after the decision, what is missing, whom to blame), ``agreement`` (the coordinator's decision: the
  contributors, the failed reducers and their replacements), ``deciding`` (the calls that bring the
  decision), ``serving`` (the handlers a member answers its group with), ``gathering`` (fetching the
  results, relays around a failed or hung reducer), ``round_tensors`` and ``reducer`` (the memory and
  the sums), ``signals`` (what the round's tasks wait on);
- the wire: ``protocol`` (messages, the signed manifest and decision, ``RoundSettings``),
  ``compression`` and ``sparse`` (encodings), ``robust`` (aggregation rules), ``audit`` and
  ``auditor`` (checking reducers after a round).

A reducer's failure: ``agreement`` declares it and names a replacement, ``round_machine`` turns that
into each member's plan, ``gathering`` routes around a reducer that fails or hangs while serving.
"""

from .allreduce import RoundResult
from .averager import Averager
from .compression import Compression
from .settings import AveragerConfig, RoundPolicy

__all__ = ["Averager", "AveragerConfig", "Compression", "RoundPolicy", "RoundResult"]
