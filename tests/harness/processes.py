"""Real ``p2ptrain`` processes for the end-to-end tests, driven only through the command line, files and
the network: ``CLI`` (the command), ``wait_until`` (a deadline on the outside world) and ``NodeProc`` (a
``p2ptrain node`` in its own folder, with its logs and status file; the ``nodes`` fixture of
``tests/e2e/conftest.py`` starts them and kills whatever a test left running).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "p2ptrain"]
TIMEOUT = 60.0  # (a busy machine: every process imports torch)


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    """Poll a condition on the outside world (files written by another process) up to a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


class NodeProc:
    """``p2ptrain node`` in ``tmp/name`` (run ``e2e``, any port on loopback), with ``extra`` arguments."""

    def __init__(self, tmp: Path, name: str, *extra: str) -> None:
        self.folder = tmp / name
        self.folder.mkdir(exist_ok=True)  # a node restarted on the same folder keeps its identity
        self.status_file = self.folder / "status.json"
        run = len(list(self.folder.glob("stdout*.log")))
        self.log = open(self.folder / f"stderr{run}.log", "w+")  # noqa: SIM115
        self.out = open(self.folder / f"stdout{run}.log", "w+")  # noqa: SIM115
        args = ["node", "--listen", "127.0.0.1:0", "--data-dir", str(self.folder), "--run-id", "e2e"]
        args += ["--status-file", str(self.status_file), *extra]
        self.proc = subprocess.Popen([*CLI, *args], stdout=self.out, stderr=self.log, text=True)

    def status(self) -> dict[str, Any] | None:
        return read_json(self.status_file)

    def connected(self) -> list[str]:
        """The peers its status file says it is connected to."""
        return list((self.status() or {}).get("connected_peers", []))

    def address(self) -> str:
        line = wait_until("the join address on stdout", lambda: Path(self.out.name).read_text().strip())
        first = line.splitlines()[0]
        assert first.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in first
        return first

    def stderr(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then its exit status. The bound is generous (a busy machine may take its time);
        the logs are closed however it ends (else a ResourceWarning fails some other test)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()
            self.out.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
