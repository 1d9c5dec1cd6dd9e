"""Hosts of our own for multi-host tests: one Linux network namespace per host, each with
its own address on a private subnet, joined by veth pairs to a bridge that lives in a
namespace of its own (the "switch"). Nothing touches the machine's own namespace, and
`Net.remove` deletes everything (namespaces take their veths and processes' sockets
with them). Needs root and iproute2 (`ip`, `tc`); impairing a link needs tc netem, or
ethtool where the kernel has no netem."""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

SUBNET = "10.77.0"


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def require() -> None:
    """Fails (never skips) when the machine cannot make namespaces: CI runs as root."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.fail("multi-host tests need root and iproute2 (ip, tc); .ci/run installs them", pytrace=False)


CLONE_NEWNET = 0x40000000
_made = 0  # Nets made by this process: each gets names of its own


def enter(ns: str) -> None:
    """Moves the calling thread into network namespace `ns` (sockets it opens live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Net:
    """Hosts `names` at 10.77.0.1, .2, ... in that order."""

    def __init__(self, names: list[str]):
        require()
        global _made
        _made += 1
        tag = f"{os.getpid() % 100000}-{_made}"
        self.switch = f"pdm-sw-{tag}"
        self.ns = {n: f"pdm-{n}-{tag}" for n in names}
        self.addr = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)}
        self.port = {n: f"p{i}" for i, n in enumerate(names)}
        self.delayed: dict[str, subprocess.Popen] = {}  # host -> its user-space delay link
        try:
            sh("ip", "netns", "add", self.switch)
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for n in names:
                ns = self.ns[n]
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", self.switch, "link", "add", self.port[n], "type", "veth", "peer", "name", "eth0", "netns", ns)
                sh("ip", "-n", self.switch, "link", "set", self.port[n], "master", "br0", "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
        except subprocess.CalledProcessError as e:
            self.remove()
            pytest.fail(f"creating the test hosts: {e.cmd}: {e.stderr}", pytrace=False)

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run inside `host`'s namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def etc(self, host: str, name: str, text: str) -> None:
        """A file of `host`'s own /etc (`hosts`, say): `ip netns exec` mounts
        /etc/netns/<namespace>/<name> over /etc/<name> for what it runs there."""
        d = os.path.join("/etc/netns", self.ns[host])
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            f.write(text)

    def threads(self, host: str, n: int) -> cf.ThreadPoolExecutor:
        """A thread pool whose threads are inside `host`: a client there, for real."""
        return cf.ThreadPoolExecutor(n, initializer=enter, initargs=(self.ns[host],))

    def connect_seconds(self, host: str, addr: str, port: int) -> float:
        """How long a TCP connect from inside `host` to `addr:port` takes (one round trip)."""
        def connect() -> float:
            t0 = time.monotonic()
            socket.create_connection((addr, port), timeout=30).close()
            return time.monotonic() - t0
        with self.threads(host, 1) as ex:
            return ex.submit(connect).result()

    def link(self, host: str, up: bool) -> None:
        """Takes `host`'s only link down (or back up), at its switch port."""
        sh("ip", "-n", self.switch, "link", "set", self.port[host], "up" if up else "down")

    def impair(self, host: str, delay_ms: int, loss_pct: int) -> str:
        """Delay and loss on everything `host` sends, with tc netem; where the kernel has no
        netem qdisc, with tests/e2e/delay_link.py (the same impairment in user space) between
        the host's switch port and the bridge. Returns what was applied."""
        ns = self.ns[host]
        r = sh("tc", "-n", ns, "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%", check=False)
        if r.returncode == 0:
            return f"netem delay {delay_ms}ms loss {loss_pct}%"
        if "unknown" not in r.stderr.lower() or not shutil.which("ethtool"):
            pytest.fail(f"impairing {host}'s link: {r.stderr} (and no ethtool for the user-space link)", pytrace=False)
        # Frames cross the delaying link whole, so no host may hand the wire segments
        # bigger than a frame or checksums left for the card to fill in.
        for h in self.ns:
            self._offloads(h, on=False)
        port, bridged = self.port[host], f"q{self.port[host]}"
        sh("ip", "-n", self.switch, "link", "set", port, "nomaster")
        sh("ip", "-n", self.switch, "link", "add", bridged, "type", "veth", "peer", "name", f"r{port}")
        sh("ip", "-n", self.switch, "link", "set", bridged, "master", "br0", "up")
        sh("ip", "-n", self.switch, "link", "set", f"r{port}", "up")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_link.py")
        link = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, script, port, f"r{port}", str(delay_ms), str(loss_pct), "900"],
            stdout=subprocess.PIPE, text=True)
        self.delayed[host] = link
        if link.stdout.readline().strip() != "ready":  # "" once it exited
            pytest.fail(f"the user-space delay link for {host} did not start (exit {link.wait(timeout=10)})", pytrace=False)
        return f"user-space link delay {delay_ms}ms loss {loss_pct}% (this kernel has no netem)"

    def _offloads(self, host: str, on: bool) -> None:
        # Turning them off must work (else whole frames would not fit the link); turning
        # them back on is best effort.
        state = "on" if on else "off"
        sh("ip", "netns", "exec", self.ns[host], "ethtool", "-K", "eth0", "tx", state, "tso", state, "gso", state, check=not on)

    def clear(self, host: str) -> None:
        ns = self.ns[host]
        sh("tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root", check=False)
        link = self.delayed.pop(host, None)
        if link is not None:
            link.terminate()
            link.wait(timeout=10)
            port = self.port[host]
            sh("ip", "-n", self.switch, "link", "del", f"q{port}", check=False)
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            if not self.delayed:
                for h in self.ns:
                    self._offloads(h, on=True)

    def remove(self) -> None:
        for link in self.delayed.values():
            link.kill()
            link.wait(timeout=10)
        self.delayed.clear()
        for ns in [*self.ns.values(), self.switch]:
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
