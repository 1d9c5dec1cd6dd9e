"""A hostile peer on the mesh's host: every internal gRPC service of a running `pdmesh up`
mesh and its cache service's page transport, called without the mesh token and with a
wrong one, refuse (UNAUTHENTICATED), allocate nothing and count the refusal; the token
`up` made reaches its children in their environment only, never a command line."""

from __future__ import annotations

import re
import secrets
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


def call(port: int, method: str, token: str | None, stream: bool = False) -> str:
    """One call with an empty request: "OK" or the status code's name."""
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            if stream:
                for _ in ch.unary_stream(method)(b"", timeout=10, metadata=metadata):
                    break
            else:
                ch.unary_unary(method)(b"", timeout=10, metadata=metadata)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def hello(port: int, token: bytes) -> bytes:
    """The page transport's hello (version 3) with `token` and a made-up layout: what the
    receiver answers before it closes."""
    frame = b"PDKV" + struct.pack("<H", 3) + bytes([len(token)]) + token
    frame += struct.pack("<QQ", 1234, 4096) + struct.pack("<I", 4) + b"fake"
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
