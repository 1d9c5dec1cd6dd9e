"""Ports for programs that cannot bind port 0 and report the port they got (the smg
gateway refuses port 0; llama.cpp's server does not print it).

No port is ever picked by binding one and letting it go: another process could take it
in between. Instead a port is drawn at random below the kernel's ephemeral range
(`net.ipv4.ip_local_port_range`), where neither a bind of port 0 nor an outgoing
connection ever lands, so only another program given a fixed port could hold it; the
caller starts the program again on a fresh draw if it finds the port taken (`TRIES`)."""

from __future__ import annotations

import random
from pathlib import Path

# How many draws a caller makes before it gives up: a clash needs another fixed-port
# program on the same draw from about 20,000 ports.
TRIES = 5

# What a program's log says when its port was taken.
IN_USE = ("address already in use", "addrinuse", "address in use")


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def outside_ephemeral() -> int:
    """A random port no bind of port 0 and no outgoing connection can hold."""
    lo, hi = ephemeral_range()
    if lo > 12000:
        return random.randrange(10000, lo)
    return random.randrange(hi + 1, 65536)


def port_was_taken(log: str) -> bool:
    low = log.lower()
    return any(s in low for s in IN_USE)
