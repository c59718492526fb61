"""Tools for testing a Ray gang, kept out of the main API: a fault injector (kill or hang one worker at
a step, to see the launcher recover) and the TCP listeners of this machine (to check that a local
cluster binds loopback only)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("jaxloom.ray")


@dataclasses.dataclass(frozen=True)
class FaultInjector:
    """A trainer hook that breaks one worker on purpose: at the start of step `at_step` of gang attempt
    `attempt`, on rank `rank`, it kills its own process with SIGKILL (`kind="kill"`) or sleeps for
    `seconds` (`kind="hang"`). With `wait_for_checkpoint`, it first lets the checkpoint being written
    finish, so the resume point is known. For chaos tests of the launcher's recovery; never on by default."""

    at_step: int
    rank: int = 0
    attempt: int = 0
    kind: str = "kill"
    seconds: float = 3600.0
    wait_for_checkpoint: bool = False

    def __post_init__(self):
        if self.kind not in ("kill", "hang"):
            raise ValueError(f"FaultInjector.kind {self.kind!r}; expected 'kill' or 'hang'")

    def bind(self, ctx) -> _BoundFault | None:
        """The hook for this worker (`ctx`), or None when the fault is for another rank or attempt."""
        return _BoundFault(self) if (ctx.rank, ctx.attempt) == (self.rank, self.attempt) else None


class _BoundFault:
    def __init__(self, fault: FaultInjector):
        self.fault = fault

    def on_step_start(self, run, step: int) -> None:
        if step != self.fault.at_step:
            return
        if self.fault.wait_for_checkpoint:
            run.checkpoints.wait_until_finished()
        log.error("FaultInjector: %s at step %d (pid %d)", self.fault.kind, step, os.getpid())
        if self.fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.fault.seconds)


def listening_addresses() -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN state on this machine (Linux `/proc/net/tcp*`)."""
    out = set()
    for name, width in (("tcp", 8), ("tcp6", 32)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            out.add((_ip(hex_ip, width), int(hex_port, 16)))
    return out


def _ip(hex_ip: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_ip)
    # /proc stores each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words) if width == 8 else ipaddress.IPv6Address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip)
