"""A site's rendezvous port is held from before any rank starts until its ranks are done: nothing else
can bind it in between. A port found free and let go before rank 0 bound it was taken in between once (a
spawned site's rank 0 failed with EADDRINUSE in a CI run); here a racer tries to take the port at the
moment the ranks would start, for :func:`launch.spawn` and for :meth:`SiteGroup.start`."""

from __future__ import annotations

import errno
import socket
from typing import Any

import pytest
import torch.distributed as dist

from p2ptrain.training.site import group as group_module
from p2ptrain.training.site import launch
from p2ptrain.training.site.group import SiteGroup


def taken(port: int) -> bool:
    """Whether a racer fails to bind ``port`` on the rendezvous address because someone holds it."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE, e
            return True
        return False


def rank_fn(rank: int, world: int) -> None:  # (never run: the spawn is replaced)
    raise AssertionError("not spawned")


def test_spawns_ranks_at_a_port_the_launcher_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def racing_spawn(entry: Any, args: tuple[Any, ...], nprocs: int, join: bool) -> None:
        port = args[2]  # (fn, world, port, timeout, device, args)
        assert taken(port), f"port {port} was free when the ranks started"
        seen.append(port)

    monkeypatch.setattr(launch.mp, "spawn", racing_spawn)
    for world in (1, 2, 4):
        launch.spawn(rank_fn, world, timeout=5.0)
    assert len(seen) == 3 and all(p > 0 for p in seen)


class RacingContext:
    """A spawn context whose processes, instead of starting, check that the port they were given is held
    and check in at the store there."""

    def __init__(self) -> None:
        self.ports: list[int] = []

    def Process(self, target: Any, args: tuple[Any, ...], daemon: bool) -> Any:  # (multiprocessing's name)
        ports = self.ports

        class Racer:
            pid = None

            def start(self) -> None:
                rank, world, port = args[:3]
                assert taken(port), f"port {port} was free when rank {rank} started"
                ports.append(port)
                store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
                store.set(f"up/{rank}", "")  # (as a rank does once it reached the store)

            def is_alive(self) -> bool:
                return True

        return Racer()


def test_a_site_group_starts_its_ranks_at_a_port_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    context = RacingContext()
    monkeypatch.setattr(group_module.mp, "get_context", lambda method: context)
    joined: list[int] = []
    monkeypatch.setattr(group_module.dist, "init_process_group", lambda *a, **k: joined.append(k["rank"]))
    site = SiteGroup(3, rank_fn)
    site.start()
    assert len(context.ports) == 2 and len(set(context.ports)) == 1 and joined == [0]
    assert taken(context.ports[0])  # (held still, once the group is up)
