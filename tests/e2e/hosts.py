"""The mesh over three hosts of our own (network namespaces, see `netns`): a gateway host
(gateway + tokenizer), a prefill host (cache service + prefill worker) and a decode host
(cache service + decode worker), each service a real process listening on its host's own
address. Clients run on threads inside the gateway's host."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
from pathlib import Path

import openai

from conftest import (API_KEY, ROOM_ARGS, WORKER_ARGS, http, parse_metrics, pdmesh_bin, stop_procs, wait_baseline,
                      wait_healthy)
from netns import Net

REQUEST_DEADLINE_S = 40
MODEL = "SmolLM2-135M-Instruct"
PEER_ARGS = ["--peer-io-timeout-ms=2000"]


def host_roles(host: str) -> list[str]:
    """The mesh roles of a test host's services: the gateway host runs the gateway and
    the tokenizer, every other host a worker and its cache service."""
    return ["gateway", "tokenizer"] if host == "gw" else ["worker", "cache"]


def make_certs(out: Path, hosts: dict[str, list[str]], ca_name: str = "pdmesh test CA") -> dict:
    """A CA and, for each host, a certificate naming its IP addresses (for serving and
    for dialling out) and its services' roles (one subject OU each, `host_roles`), made
    with the openssl command line. Returns {"ca": path, host: (cert, key)} as strings."""
    out.mkdir(parents=True, exist_ok=True)
    run = lambda *argv: subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=out)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", f"/CN={ca_name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    certs = {"ca": str(out / "ca.pem")}
    for host, ips in hosts.items():
        (out / f"{host}.ext").write_text(
            "subjectAltName=" + ",".join(f"IP:{ip}" for ip in ips) + "\n"
            "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
        run("req", *ec, "-keyout", f"{host}.key", "-out", f"{host}.csr", "-subj",
            "".join(f"/OU={r}" for r in host_roles(host)) + f"/CN={host}")
        run("x509", "-req", "-in", f"{host}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{host}.pem", "-days", "2", "-extfile", f"{host}.ext")
        certs[host] = (str(out / f"{host}.pem"), str(out / f"{host}.key"))
    return certs


class Hosts:
    """Three hosts and their services, each process killable, stoppable and restartable."""

    PORTS = {"cache": 7100, "worker": 7200, "tokenizer": 7300, "gateway": 8080}

    def __init__(self, tmp: Path, decode_args=(), prefill_args=(), short_deadlines=True, model: Path | None = None, worker_args=(), prefill_on_decode_host=False, tls=False, via_up=False, cache_args=()):
        """`short_deadlines`: the fault tests' room and hand-over deadlines (conftest's), so
        faults resolve within a test; otherwise the services' defaults. `tls`: every
        service runs with the mesh's mutual TLS, each host with a certificate of its own
        (`self.certs`) from one CA made for the test. `via_up`: each host runs one
        `pdmesh up --role ...` (named after the host) instead of its services one by one."""
        room_args = [*(ROOM_ARGS + PEER_ARGS if short_deadlines else []), *cache_args]
        worker_args = [*(WORKER_ARGS if short_deadlines else []), *worker_args]
        model_args = ["--model", str(model)] if model else []
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.net = Net(["gw", "prefill", "decode"])
        self.procs: dict[str, subprocess.Popen] = {}
        a = self.net.addr
        url = lambda host, svc: f"http://{a[host]}:{self.PORTS[svc]}"
        self.cache_urls = [url("prefill", "cache"), url("decode", "cache")]
        # name: (host, argv)
        self.argv = {
            "prefill-cache": ("prefill", ["cache", "--listen", f"{a['prefill']}:7100", *room_args]),
            "decode-cache": ("decode", ["cache", "--listen", f"{a['decode']}:7100", *room_args]),
            "prefill": ("prefill", ["prefill", "--listen", f"{a['prefill']}:7200", "--cache-url", url("prefill", "cache"), *model_args, *worker_args, *prefill_args]),
            "decode": ("decode", ["decode", "--listen", f"{a['decode']}:7200", "--cache-url", url("decode", "cache"), *model_args, *worker_args, *decode_args]),
            # The tokenizer shares the gateway's host, so it may stay on that host's loopback.
            "tokenizer": ("gw", ["tokenizer", "--listen", "127.0.0.1:7300", *model_args]),
            "gateway": ("gw", [
                "gateway", "--listen", f"{a['gw']}:8080",
                "--tokenizer-url", "http://127.0.0.1:7300",
                "--prefill-url", url("prefill", "worker"),
                "--decode-url", url("decode", "worker"),
                "--cache-url", ",".join(self.cache_urls),
            ]),
        }
        self.certs = make_certs(tmp / "certs", {h: [a[h], "127.0.0.1"] for h in a}) if tls else None
        # One mesh token for every host (each process gets it in its environment). Without
        # TLS the services listen beyond loopback in clear, which they refuse unless told.
        self.token = secrets.token_hex(32)
        for name, (host, argv) in self.argv.items():
            if tls:
                argv += ["--tls-ca", self.certs["ca"], "--tls-cert", self.certs[host][0], "--tls-key", self.certs[host][1]]
            else:
                argv.append("--insecure-plaintext")
        if not tls:
            # With the mesh token alone, a cache service relays rooms only to the cache
            # services its --peer list names (with TLS, the home's certificate decides).
            for name, other in (("prefill-cache", "decode"), ("decode-cache", "prefill")):
                self.argv[name][1].append(f"--peer={url(other, 'cache')}")
        if via_up:
            assert not prefill_on_decode_host, "not combined"
            self.argv = self.up_argv(room_args, model_args, worker_args, prefill_args, decode_args)
        self.base = f"http://{a['gw']}:8080"
        self.client = self.net.threads("gw", 128)
        if prefill_on_decode_host:
            assert not tls, "not combined"
            # A second prefill worker, beside decode, sharing that host's cache service.
            self.argv["prefill2"] = ("decode", ["prefill", "--listen", f"{a['decode']}:7201", "--cache-url", url("decode", "cache"), *model_args, *worker_args, "--insecure-plaintext"])
            gw = self.argv["gateway"][1]
            gw[gw.index("--prefill-url") + 1] += f",http://{a['decode']}:7201"
        try:
            for name in self.argv:
                self.start(name)
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def up_argv(self, room_args, model_args, worker_args, prefill_args, decode_args) -> dict:
        """The same mesh as one `pdmesh up --role` per host (its cache service and workers at
        the ports above)."""
        a = self.net.addr
        if self.certs:
            tls = lambda h: ["--tls-ca", self.certs["ca"], "--tls-cert", self.certs[h][0], "--tls-key", self.certs[h][1]]
        else:
            tls = lambda h: ["--insecure-plaintext"]
        other = {"prefill": "decode", "decode": "prefill"}
        peer = lambda role: [] if self.certs else [f"--cache-arg=--peer=http://{a[other[role]]}:{self.PORTS['cache']}"]
        part = lambda role, extra: (role, [
            "up", "--role", role, "--host", a[role], *model_args, *tls(role), *peer(role),
            *(f"--cache-arg={x}" for x in room_args), *(f"--worker-arg={x}" for x in worker_args),
            *(f"--{role}-arg={x}" for x in extra)])
        return {
            "decode": part("decode", decode_args),
            "prefill": part("prefill", prefill_args),
            "gw": ("gw", ["up", "--role", "gateway", "--host", a["gw"], "--port", "8080", *model_args, *tls("gw"),
                          "--prefill-url", f"http://{a['prefill']}:7200", "--decode-url", f"http://{a['decode']}:7200",
                          "--cache-url", ",".join(self.cache_urls)]),
        }

    def start(self, name: str) -> None:
        host, argv = self.argv[name]
        log = open(self.tmp / f"{name}.log", "ab")
        env = dict(os.environ, PDMESH_API_KEY=API_KEY, PDMESH_MESH_TOKEN=self.token)
        cmd = self.net.exec_argv(host, [str(pdmesh_bin()), *argv])
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def http(self, method: str, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
        """One request to the gateway from a thread inside the gateway's host."""
        return self.client.submit(http, method, self.base + path, json.dumps(body).encode() if body else None,
                                  {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}, timeout).result()

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_healthy(self.procs, lambda: self.http("GET", "/health", timeout=5)[0], self.logs, timeout, poll=0.3)

    def openai(self) -> openai.OpenAI:
        """An openai client for the gateway; call it only from `self.client`'s threads."""
        return openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(timeout=30)

    def metrics(self) -> dict[str, float]:
        status, body = self.http("GET", "/metrics")
        assert status == 200, body
        return parse_metrics(body.decode())

    def chat(self, messages: list[dict], wait_s: float = REQUEST_DEADLINE_S, **kw) -> tuple[str, object]:
        """('ok', response JSON) or ('error', HTTP status), from inside the gateway host;
        `wait_s` bounds the wait for the answer."""
        body = {"model": MODEL, "messages": messages, **kw}
        status, body = self.http("POST", "/v1/chat/completions", body, timeout=wait_s)
        if status == 200:
            return "ok", json.loads(body)
        err = json.loads(body)
        assert err["error"]["message"], "an error says what happened"
        return "error", status

    def assert_baseline(self, timeout: float = 30) -> dict[str, float]:
        """Nothing held on any host: no request in a worker, no reserved page, no open
        room, no mirror slot held by a room on either cache service."""
        return wait_baseline(self.metrics, self.logs, timeout, caches=True)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        stop_procs(self.procs.values())
        self.client.shutdown()
        self.net.remove()
        # A cache service killed with SIGKILL leaves its mirror file behind.
        for log in self.tmp.glob("*cache.log"):
            for path in re.findall(r"host mirror created path=(\S+)", log.read_text(errors="replace")):
                Path(path).unlink(missing_ok=True)
