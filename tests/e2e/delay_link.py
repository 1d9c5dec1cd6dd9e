"""A delaying, lossy link for kernels without tc netem: run inside the switch namespace
of tests/e2e/netns.py, between a host's switch port and a veth whose other end is on the
bridge. Every frame the host sends is held for DELAY_MS and a share LOSS_PCT of them is
dropped (at random); frames to the host pass at once, as with netem on the host's eth0.

    python3 delay_link.py HOST_PORT BRIDGE_PORT DELAY_MS LOSS_PCT MAX_SECONDS

Frames are read and written whole with packet sockets, so the hosts' segmentation and
checksum offloads must be off while it runs (Net.impair does that). It prints `ready` once
both sockets are bound, and stops by itself after MAX_SECONDS, or when its parent dies.
"""

from __future__ import annotations

import ctypes
import heapq
import os
import random
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
PR_SET_PDEATHSIG = 1


def packet_socket(dev: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind((dev, 0))
    s.setblocking(False)
    return s


def main() -> None:
    host_port, bridge_port = sys.argv[1], sys.argv[2]
    delay, loss, life = float(sys.argv[3]) / 1000, float(sys.argv[4]), float(sys.argv[5])
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.getppid()
    host_side, bridge_side = packet_socket(host_port), packet_socket(bridge_port)
    print("ready", flush=True)  # Net.impair waits for this line
    held: list[tuple[float, int, bytes]] = []  # (when due, arrival order, frame)
    arrivals = 0
    end = time.monotonic() + life
    while time.monotonic() < end and os.getppid() == parent:
        now = time.monotonic()
        while held and held[0][0] <= now:
            frame = heapq.heappop(held)[2]
            try:
                bridge_side.send(frame)
            except OSError as e:  # a frame the far side cannot take is lost, as on a wire
                print(f"delay_link: dropped a {len(frame)}-byte frame: {e}", file=sys.stderr, flush=True)
        wait = min(held[0][0] - now, 0.5) if held else 0.5
        ready, _, _ = select.select([host_side, bridge_side], [], [], max(wait, 0))
        for s in ready:
            while True:
                try:
                    frame, addr = s.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] == socket.PACKET_OUTGOING:
                    continue  # a frame this program sent
                if s is bridge_side:
                    try:
                        host_side.send(frame)
                    except OSError as e:
                        print(f"delay_link: dropped a {len(frame)}-byte frame: {e}", file=sys.stderr, flush=True)
                elif random.random() * 100 >= loss:
                    arrivals += 1
                    heapq.heappush(held, (time.monotonic() + delay, arrivals, frame))


if __name__ == "__main__":
    main()
