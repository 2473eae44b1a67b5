"""``p2ptrain authority init | pubkey | issue | show``: the keys and membership certificates of a private
swarm (see :mod:`p2ptrain.authority`)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .. import authority as auth
from ..identity import Identity, PeerID, load_identity, save_identity
from ..nodebase import validate_run_id
from .common import UsageError


def cmd_authority(args: argparse.Namespace) -> int:
    """``p2ptrain authority init | pubkey | issue | show``: keys and certificates of a private swarm."""
    if args.authority_command == "init":
        key = Identity.generate()
        save_identity(key, args.out, overwrite=args.force)
        text = auth.authority_key_text(key.public_key)
        with open(args.out, "a") as f:  # what to paste into --authority, beside the key
            f.write(f"# authority public key: {text}\n")
        print(text)
        return 0
    if args.authority_command == "pubkey":
        print(auth.authority_key_text(load_identity(args.keyfile).public_key))
        return 0
    if args.authority_command == "issue":
        return _issue_certificate(args)
    return _show_certificate(args)


def _issue_certificate(args: argparse.Namespace) -> int:

    try:
        peer = PeerID.from_string(args.peer)
    except ValueError as e:
        raise UsageError(f"--peer: {e}") from None
    if args.run is not None:
        validate_run_id(args.run)
    lifetime = auth.parse_duration(args.expires)
    key = load_identity(args.key)
    now = float(int(time.time()))
    data = auth.issue_certificate(key, peer, not_before=now, expires=now + lifetime, run=args.run or "")
    auth.save_certificate(data, args.out, overwrite=args.force)
    cert = auth.decode_certificate(data, key.public_key)
    run = f"run {cert.run!r}" if cert.run else "any run of this authority"
    print(f"{args.out}: peer {cert.peer} in {run}, expires {auth.format_time(cert.expires)}")
    return 0


def _show_certificate(args: argparse.Namespace) -> int:

    data = auth.load_certificate(args.certificate)
    expected = auth.parse_authority_key(args.authority) if args.authority else None
    cert = auth.decode_certificate(data, expected)  # CertificateRejected: one line, exit 1
    now = time.time()
    if now >= cert.expires:
        state = f"expired on {auth.format_time(cert.expires)}"
    elif now < cert.not_before - auth.NOT_BEFORE_SKEW:
        state = f"not valid before {auth.format_time(cert.not_before)}"
    else:
        state = f"valid for {(cert.expires - now) / 86400:.1f} more days"
    signature = "verified" + (" (issued by this authority)" if expected else "")
    fields = cert.fields() | {"signature": signature, "state": state}
    if args.json:
        print(json.dumps(fields, indent=2))
    else:
        for name, value in fields.items():
            print(f"{name + ':':<12}{value}")
    return 0


def add_parsers(sub: Any) -> None:
    """The ``authority`` subcommand's parser, under ``sub`` (the command's subparsers)."""
    s = sub.add_parser(
        "authority",
        help="a private swarm: the authority key and the members' certificates",
        description="Nodes started with --authority PUBKEY refuse peers, DHT records and round members"
        " without a valid membership certificate from that authority. Renew certificates before they"
        " expire and restart the node with the new file.",
    )
    cmds = s.add_subparsers(dest="authority_command", required=True)
    c = cmds.add_parser("init", help="create the authority key (mode 0600) and print its public key")
    c.add_argument("--out", required=True, help="key file to create; keep it off the nodes")
    c.add_argument("--force", action="store_true", help="overwrite an existing key file")
    c = cmds.add_parser("pubkey", help="print the public key of an authority key file")
    c.add_argument("keyfile")
    c = cmds.add_parser("issue", help="issue a membership certificate to a peer")
    c.add_argument("--key", required=True, help="the authority key file")
    c.add_argument("--peer", required=True, metavar="PEERID", help="the member's peer id (`p2ptrain id`)")
    c.add_argument("--expires", required=True, metavar="DURATION", help="e.g. 12h, 30d, 2w")
    c.add_argument("--run", metavar="RUNID", help="only this run (default: any run of this authority)")
    c.add_argument("--out", required=True, help="certificate file to write")
    c.add_argument("--force", action="store_true", help="overwrite an existing certificate file")
    c = cmds.add_parser("show", help="print a certificate's fields and whether it is valid now")
    c.add_argument("certificate", help="certificate file")
    c.add_argument("--authority", metavar="PUBKEY", help="also check that this authority issued it")
    c.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_authority)
