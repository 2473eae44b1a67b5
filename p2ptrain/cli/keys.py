"""``p2ptrain keygen`` and ``p2ptrain id``: create an identity, print a key file's peer id."""

from __future__ import annotations

import argparse
from typing import Any

from ..identity import Identity, load_identity, save_identity


def cmd_keygen(args: argparse.Namespace) -> int:
    identity = Identity.generate()
    save_identity(identity, args.out, overwrite=args.force)
    print(identity.peer_id)
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    print(load_identity(args.keyfile).peer_id)
    return 0


def add_parsers(sub: Any) -> None:
    """The ``keygen`` and ``id`` commands' parsers, under ``sub`` (the command's subparsers)."""
    s = sub.add_parser("keygen", help="create an Ed25519 identity (key file mode 0600)")
    s.add_argument("--out", required=True, help="key file to create")
    s.add_argument("--force", action="store_true", help="overwrite an existing key file")
    s.set_defaults(func=cmd_keygen)

    s = sub.add_parser("id", help="print the peer id of a key file")
    s.add_argument("keyfile")
    s.set_defaults(func=cmd_id)
