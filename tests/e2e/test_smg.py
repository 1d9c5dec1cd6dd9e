"""The smg gateway (pinned, from PyPI) driving pdmesh workers over SGLang's scheduler gRPC
protocol: a unified worker, and a prefill + decode pair with the cache service as the
bootstrap endpoint. Through smg's OpenAI endpoint, greedy answers are identical to
pdmesh's own gateway's, streamed and not; smg routes by the workers' KV events; and a
client leaving mid-stream frees the workers' pages."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time

import openai
import pytest

import ports
from conftest import fixture, http, start_up, stop_up

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rust.",
    "List three prime numbers.",
]


class Smg:
    def __init__(self, args: list[str], log_path):
        # smg refuses port 0: its two ports are drawn outside the ephemeral range, and
        # drawn again if another program holds one (see ports.py).
        self.log_path = log_path
        for _ in range(ports.TRIES):
            self.port, self.metrics_port = ports.outside_ephemeral(), ports.outside_ephemeral()
            if self.port != self.metrics_port and self.start(args):
                return
        pytest.fail(f"smg found its port taken {ports.TRIES} times:\n{log_path.read_text()}", pytrace=False)

    def start(self, args: list[str]) -> bool:
        """Starts smg and waits until it serves; False if its port was taken."""
        cmd = [
            sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port), *args,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                log = self.log_path.read_text()
                if ports.port_was_taken(log):
                    return False
                pytest.fail(f"smg exited with {self.proc.returncode}:\n{log}", pytrace=False)
            try:
                status, body = http("GET", self.base + "/v1/models", timeout=5)
                # Listing the model comes before smg has fetched its tokenizer from the
                # worker (503 "not registered yet"): ready means a request is served.
                if status == 200 and b"SmolLM2" in body and self.serves():
                    return True
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"smg not ready:\n{self.log_path.read_text()}", pytrace=False)
            time.sleep(0.5)

    def serves(self) -> bool:
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                           "messages": [{"role": "user", "content": "Ready?"}]}).encode()
        status, text = http("POST", self.base + "/v1/chat/completions", body,
                            {"Content-Type": "application/json"}, timeout=30)
        if status == 503:
            return False
        assert status == 200, (status, text)
        return True

    def metric(self, series: str) -> float:
        status, body = http("GET", f"http://127.0.0.1:{self.metrics_port}/metrics")
        assert status == 200
        for line in body.decode().splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def answers(client: openai.OpenAI, model: str) -> list:
    out = []
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
        s = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
        c = client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0)
        cs = client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0, stream=True)
        cstreamed = "".join(ch.choices[0].text for ch in cs if ch.choices)
        out.append((r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens,
                    streamed, c.choices[0].text, cstreamed))
    return out


def f32(x: float) -> float:
    """x as the f32 the worker sent (JSON writers print an f32 with more or fewer digits)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def scored(client: openai.OpenAI, model: str) -> list:
    """Each generated token's logprob and its two alternatives', as f32 values."""
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    return [(t.token, f32(t.logprob), [(x.token, f32(x.logprob)) for x in t.top_logprobs])
            for t in r.choices[0].logprobs.content]


CITY = fixture("city_schema.json")


def city(client: openai.OpenAI, model: str) -> tuple:
    """(finish_reason, content) for a json_schema answer; the schema names three properties
    and says nothing of others."""
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON for the city of Cairo with its population."}],
        max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
    )
    return r.choices[0].finish_reason, r.choices[0].message.content


def pages_in_use(mesh) -> float:
    m = mesh.metrics()
    assert m["mesh_workers_read"] == 1
    return m["mesh_kv_pages_capacity"] - m["mesh_kv_pages_free"] - m["mesh_kv_pages_cached"]


def leave_mid_stream(client: openai.OpenAI, model: str):
    s = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(s):
        if i == 3:
            break
    s.response.close()


def wait_pages(mesh, want: float):
    deadline = time.monotonic() + 60
    while (used := pages_in_use(mesh)) != want:
        assert time.monotonic() < deadline, f"{used} pages still held (baseline {want})"
        time.sleep(0.2)


def choices_through(smg, mesh) -> None:
    """n choices through smg: greedy, each is pdmesh's greedy answer; sampled, each its own
    draw."""
    ask = dict(model=mesh.model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=12)
    greedy = smg.client().chat.completions.create(n=3, temperature=0, **ask)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    one = mesh.client().chat.completions.create(temperature=0, **ask).choices[0].message.content
    assert [c.message.content for c in greedy.choices] == [one] * 3
    hot = smg.client().chat.completions.create(n=3, temperature=1.0, **ask)
    assert sorted(c.index for c in hot.choices) == [0, 1, 2]
    assert len({c.message.content for c in hot.choices}) > 1


def choices_and_a_client_leaving(smg, mesh) -> None:
    """[`choices_through`] smg; then a client leaving smg's stream mid-way frees every page
    its request held in the mesh."""
    choices_through(smg, mesh)
    baseline = pages_in_use(mesh)
    leave_mid_stream(smg.client(), mesh.model)
    wait_pages(mesh, baseline)


def test_smg_drives_a_unified_worker_like_pdmeshs_gateway(tmp_path):
    # smg presents no mesh credential to workers: theirs run open (--insecure-plaintext).
    mesh = start_up(tmp_path, ["--unified", "--worker-arg=--insecure-plaintext"])
    smg = None
    try:
        smg = Smg(["--worker-urls", f"grpc://127.0.0.1:{mesh.ports['worker']}"], tmp_path / "smg.log")
        ours = answers(mesh.client(), mesh.model)
        theirs = answers(smg.client(), mesh.model)
        assert theirs == ours
        # Logprobs with alternatives pass through smg with the same values.
        ours = scored(mesh.client(), mesh.model)
        assert len(ours) == 8 and all(len(top) == 2 for _, _, top in ours)
        assert scored(smg.client(), mesh.model) == ours
        # smg's json_schema reaches the worker as SGLang's json_schema constraint, strict
        # as SGLang's own: the answer holds the schema's properties only, as through
        # pdmesh's gateway, instead of invented keys up to the length limit.
        finish, content = city(smg.client(), mesh.model)
        assert finish == "stop", content
        assert set(json.loads(content)) == set(CITY["properties"]), content
        assert (finish, content) == city(mesh.client(), mesh.model)
        # smg follows the worker's KV events (SGLang blocks with their token ids) and
        # routes by them: its cache-aware policy found the prompts' pages there.
        assert "does not implement SubscribeKvEvents" not in smg.log_path.read_text()
        assert smg.metric('smg_cache_aware_policy_branch_total{branch="event_hit"}') > 0
        choices_and_a_client_leaving(smg, mesh)
    finally:
        if smg:
            smg.stop()
        stop_up(mesh)


def test_smg_drives_prefill_and_decode_workers_through_rooms(tmp_path):
    """A disaggregated mesh whose workers run open (smg presents no mesh credential): smg
    sends the same Generate to prefill and decode with its bootstrap room, and the KV
    travels through pdmesh's rooms."""
    mesh = start_up(tmp_path / "up", ["--worker-arg=--insecure-plaintext"])
    smg = None
    try:
        assert mesh.ports["mode"] == "pd"
        p, d, cache = mesh.ports["prefill"][0], mesh.ports["decode"][0], mesh.ports["cache"]
        smg = Smg(["--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{p}", str(cache),
                   "--decode", f"grpc://127.0.0.1:{d}"], tmp_path / "smg.log")
        assert mesh.metrics()['mesh_insecure_plaintext{service="worker"}'] == 1
        before = mesh.metrics()['mesh_kv_transfer_bytes_total{side="all"}']
        theirs = answers(smg.client(), mesh.model)
        moved = mesh.metrics()['mesh_kv_transfer_bytes_total{side="all"}'] - before
        assert moved > 0, "the KV went through rooms"
        ours = answers(mesh.client(), mesh.model)
        assert theirs == ours
        choices_and_a_client_leaving(smg, mesh)
    finally:
        if smg:
            smg.stop()
        stop_up(mesh)
