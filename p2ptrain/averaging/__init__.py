"""Averaging: matchmaking, partitions, the butterfly all-reduce and compression."""
