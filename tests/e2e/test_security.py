"""A hostile peer on the mesh's host: every internal gRPC service of a running `pdmesh up`
mesh and its cache service's page transport, called without the mesh token and with a
wrong one, refuse (UNAUTHENTICATED), allocate nothing and count the refusal; the token
`up` made reaches its children in their environment only, never a command line. Even
with the token, a room cannot be pointed at a home the mesh does not know, and a lease
cannot be named by an old 8-byte number."""

from __future__ import annotations

import re
import secrets
import socket
import struct
from pathlib import Path

import grpc

from conftest import raw_exchange, wait_baseline

TOKEN_ENV = "PDMESH_MESH_TOKEN"


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def call(port: int, method: str, token: str | None, stream: bool = False, request: bytes = b"") -> str:
    """One call with `request` (an encoded message; empty by default): "OK" or the status
    code's name, then its message after a colon."""
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            if stream:
                for _ in ch.unary_stream(method)(request, timeout=10, metadata=metadata):
                    break
            else:
                ch.unary_unary(method)(request, timeout=10, metadata=metadata)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name if not request else f"{e.code().name}: {e.details()}"


def field(number: int, value: bytes | int) -> bytes:
    """One protobuf field: a varint for an int, else length-delimited bytes."""
    def varint(n: int) -> bytes:
        out = b""
        while True:
            b, n = n & 0x7F, n >> 7
            out += bytes([b | (0x80 if n else 0)])
            if not n:
                return out
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def hello(port: int, token: bytes) -> bytes:
    """The page transport's hello (version 4) with `token`, a made-up lease and layout:
    what the receiver answers before it closes."""
    frame = b"PDKV" + struct.pack("<H", 4) + bytes([len(token)]) + token
    frame += secrets.token_bytes(16) + struct.pack("<QQ", 1234, 4096) + struct.pack("<I", 4) + b"fake"
    return raw_exchange("127.0.0.1", port, frame)


def test_no_internal_call_gets_in_without_the_mesh_token_and_the_token_is_in_no_command_line(mesh):
    ports, pids = mesh.ports, mesh.ports["pids"]
    children = mesh.child_pids()
    token = environ(pids["cache"])[TOKEN_ENV]
    assert len(token) == 64, "up made a 256-bit token"
    for pid in children:
        assert environ(pid).get(TOKEN_ENV) == token, f"pid {pid} holds the mesh's token"
        assert token not in cmdline(pid), f"pid {pid} shows the token on its command line"
    assert token not in cmdline(pids["up"])

    before = wait_baseline(mesh.metrics, mesh.log, caches=True)
    worker = ports["prefill"][0] if ports["mode"] == "pd" else ports["worker"]
    targets = [
        (ports["cache"], "/pdmesh.cache.v1.Cache/Register", False),
        (ports["cache"], "/pdmesh.cache.v1.Cache/Reserve", False),
        (ports["cache"], "/pdmesh.cache.v1.Cache/RoomCommit", False),
        (ports["cache"], "/pdmesh.cache.v1.Cache/SubscribeEvents", True),
        (worker, "/pdmesh.worker.v1.Worker/Generate", True),
        (worker, "/pdmesh.worker.v1.Worker/FlushCache", False),
        (worker, "/pdmesh.worker.v1.Worker/SubscribeKvEvents", True),
        (worker, "/sglang.grpc.scheduler.SglangScheduler/Generate", True),
        (ports["tokenizer"], "/pdmesh.tokenizer.v1.Tokenizer/Tokenize", False),
    ]
    wrong = secrets.token_hex(32)
    for port, method, stream in targets:
        for who, t in [("no token", None), ("a wrong token", wrong), ("the token's first half", token[:32])]:
            assert call(port, method, t, stream) == "UNAUTHENTICATED", (method, who)
    # The real token is let in (a control: the refusals above are about the credential).
    assert call(ports["cache"], "/pdmesh.cache.v1.Cache/Stats", token) == "OK"
    assert call(ports["tokenizer"], "/pdmesh.tokenizer.v1.Tokenizer/Health", token) == "OK"
    # The standard health check answers anyone: probes cannot present a credential.
    assert call(worker, "/grpc.health.v1.Health/Check", None) == "OK"

    # The page transport refuses a hello without the token, or with another, before it
    # reads the layout: status 2, then the connection closes.
    peer = int(re.findall(r"peer_port=(\d+)", mesh.log())[-1])
    for t in [b"", wrong.encode()]:
        reply = hello(peer, t)
        assert reply[:1] == b"\x02", reply

    after = wait_baseline(mesh.metrics, mesh.log, caches=True)
    assert after["mesh_host_mirror_leases"] == before["mesh_host_mirror_leases"], "no lease was handed out"
    refused = lambda m, s: m[f'mesh_auth_refused_total{{service="{s}"}}']
    # Per service: its calls above (three credentials each), and the two hellos.
    assert refused(after, "cache") - refused(before, "cache") >= 4 * 3 + 2
    assert refused(after, "worker") - refused(before, "worker") >= 4 * 3
    for s in ["gateway", "worker", "cache"]:
        assert after[f'mesh_insecure_plaintext{{service="{s}"}}'] == 0, s


def test_with_the_token_a_room_cannot_name_an_unknown_home_nor_an_8_byte_lease(mesh):
    """A member holding the mesh token (any process the token leaked to) asks the cache
    service to relay a room to a home of its choosing: refused with PERMISSION_DENIED
    naming --peer, before the service dials it (the listener sees no connection). A lease
    is 16 random bytes: an old 8-byte number is INVALID_ARGUMENT, a random one unknown."""
    ports, pids = mesh.ports, mesh.ports["pids"]
    token = environ(pids["cache"])[TOKEN_ENV]
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0)
    try:
        home = f"http://127.0.0.1:{trap.getsockname()[1]}"
        room_open = lambda lease: (field(1, lease) + field(2, 77) + field(3, 1)  # SENDER
                                   + field(6, home.encode()))
        said = call(ports["cache"], "/pdmesh.cache.v1.Cache/RoomOpen", token, request=room_open(secrets.token_bytes(16)))
        assert said.startswith("PERMISSION_DENIED") and "--peer" in said, said
        try:
            trap.accept()
            raise AssertionError("the cache service dialled the home a caller named")
        except BlockingIOError:
            pass
    finally:
        trap.close()
    heartbeat = lambda lease: field(1, lease)
    said = call(ports["cache"], "/pdmesh.cache.v1.Cache/Heartbeat", token, request=heartbeat(struct.pack("<Q", 1)))
    assert said.startswith("INVALID_ARGUMENT") and "16 bytes" in said, said
    lease = secrets.token_bytes(16)
    said = call(ports["cache"], "/pdmesh.cache.v1.Cache/Heartbeat", token, request=heartbeat(lease))
    assert said.startswith("NOT_FOUND") and lease.hex()[:8] not in said, said
