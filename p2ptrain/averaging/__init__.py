"""Averaging: matchmaking, bandwidth-weighted partitions, the butterfly all-reduce and compression."""

from .allreduce import RoundResult
from .averager import Averager
from .compression import Compression
from .settings import AveragerConfig

__all__ = ["Averager", "AveragerConfig", "Compression", "RoundResult"]
