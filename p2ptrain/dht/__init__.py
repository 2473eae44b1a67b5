"""Kademlia DHT: routing table, iterative lookup and signed records (pure), and the trio service."""

from .lookup import Lookup
from .records import Entry, RecordLimits, RecordRefused, RecordStore, key_id, make_entry, owned_subkey
from .routing import Contact, RoutingTable
from .service import DHT, DHTConfig

__all__ = [
    "DHT",
    "Contact",
    "DHTConfig",
    "Entry",
    "Lookup",
    "RecordLimits",
    "RecordRefused",
    "RecordStore",
    "RoutingTable",
    "key_id",
    "make_entry",
    "owned_subkey",
]
