"""Averaging: matchmaking, bandwidth-weighted partitions, the butterfly all-reduce and compression."""

from .allreduce import RoundResult
from .averager import Averager, AveragerConfig
from .compression import Compression

__all__ = ["Averager", "AveragerConfig", "Compression", "RoundResult"]
