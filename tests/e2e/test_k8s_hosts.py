"""The GPU overlay's topology run for real, on hosts of our own (network namespaces), as
the cluster would run it: nothing about the mesh is written here, everything is read
from `kubectl kustomize deploy/k8s/overlays/gpu-pd`.

- **Nodes**: one per node pool the workloads select (`pdmesh.io/pool`), labelled so and,
  since their pods ask for `nvidia.com/gpu`, tainted `nvidia.com/gpu:NoSchedule` as GPU
  pools are; plus one plain node for the rest.
- **Scheduling**: each pod goes to a node whose labels its nodeSelector matches and whose
  taints it tolerates; a DaemonSet's pod goes to every such node. One replica of each
  Deployment and LeaderWorkerSet group runs (a node here is one address, so two replicas
  of one pod would share its ports).
- **Pods**: the init containers run to completion, then the containers, as their args and
  env say. `$(VAR)` expands from the container's env (`status.hostIP` is the node's
  address, a Secret's key the test's API key); every path under a volume mount is
  rewritten to that volume's directory here: an emptyDir per pod, a hostPath per node
  (`/dev/shm` stays on tmpfs; another is a folder made mode 0700, as the node's
  provisioning makes the disk tier's), the `pdmesh-mesh-tls` Secret as made by
  `deploy/k8s/make-mesh-tls.sh`, the models claim as a folder holding the cached model.
- **DNS**: each host's `/etc/hosts` gives every Service and every headless pod name the
  address of the node its pod landed on (as cluster DNS would, pod for node).
- **Probes**: every container's readiness probe is asked from its node, as the kubelet
  asks it (HTTP, gRPC health, TCP).

The one change made to what the overlay says: `--device=cuda` runs as `--device=cpu`,
since no GPU is here. The answer must then be the single-host mesh's, bit for bit, after
a hand-over between the prefill node and the decode node under the mesh's mutual TLS."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import API_KEY, http, pdmesh_bin, stop_procs
from netns import Net
from test_k8s import K8S, WORKLOADS, render, templates

POOL = "pdmesh.io/pool"
GPU = "nvidia.com/gpu"
PROBE = str(Path(__file__).with_name("grpc_probe.py"))
READY_TIMEOUT_S = 180


def tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for t in tolerations:
        key_ok = t.get("key") in (None, taint["key"]) if t.get("operator") == "Exists" else (
            t.get("key") == taint["key"] and t.get("value") == taint.get("value"))
        if key_ok and t.get("effect") in (None, "", taint["effect"]):
            return True
    return False


def fits(spec: dict, node: dict) -> bool:
    sel = spec.get("nodeSelector", {})
    if any(node["labels"].get(k) != v for k, v in sel.items()):
        return False
    return all(tolerated(t, spec.get("tolerations", [])) for t in node["taints"])


def nodes_of(docs) -> dict[str, dict]:
    """The cluster the overlay asks for: a node per selected pool, and a plain one."""
    nodes = {"plain": {"labels": {}, "taints": []}}
    for d in docs:
        if d["kind"] not in WORKLOADS:
            continue
        for t in templates(d):
            pool = t["spec"].get("nodeSelector", {}).get(POOL)
            if pool:
                gpus = any(GPU in c.get("resources", {}).get("limits", {}) for c in t["spec"]["containers"])
                nodes[pool] = {"labels": {POOL: pool}, "taints": [{"key": GPU, "effect": "NoSchedule"}] if gpus else []}
    return nodes


def pod_names(d: dict) -> list[str]:
    """The name of the one pod run per workload (a DaemonSet's pods are named per node)."""
    name = d["metadata"]["name"]
    return {"Deployment": [name], "StatefulSet": [f"{name}-0"], "LeaderWorkerSet": [f"{name}-0"]}.get(d["kind"], [name])


def schedule(docs, nodes) -> list[dict]:
    """Pods: {name, workload, node, spec, labels}."""
    placed = []
    for d in docs:
        if d["kind"] not in WORKLOADS:
            continue
        [t] = templates(d)[:1]
        eligible = [n for n, node in nodes.items() if fits(t["spec"], node)]
        assert eligible, f"{d['kind']} {d['metadata']['name']} fits no node of {nodes}"
        where = eligible if d["kind"] == "DaemonSet" else eligible[:1]
        for n in where:
            name = f"{d['metadata']['name']}-{n}" if d["kind"] == "DaemonSet" else pod_names(d)[0]
            placed.append({"name": name, "workload": d, "node": n, "spec": t["spec"], "labels": t["metadata"]["labels"]})
    return placed


def dns(docs, pods, addr) -> dict[str, str]:
    """Name -> address, as cluster DNS answers (a pod's address is its node's here)."""
    names = {}
    for svc in (d for d in docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        hit = [p for p in pods if all(p["labels"].get(k) == v for k, v in sel.items())]
        assert hit, f"Service {svc['metadata']['name']} selects no pod"
        # A Service's name: its ClusterIP, or, headless, its pods' addresses (one pod here).
        names[svc["metadata"]["name"]] = addr[hit[0]["node"]]
    for p in pods:
        w = p["workload"]
        # Headless names: a StatefulSet's serviceName, a LeaderWorkerSet's own Service.
        sub = w["spec"].get("serviceName") if w["kind"] == "StatefulSet" else (
            w["metadata"]["name"] if w["kind"] == "LeaderWorkerSet" else None)
        if sub:
            names[f"{p['name']}.{sub}"] = addr[p["node"]]
    return names


class Cluster:
    def __init__(self, tmp: Path, docs, nodes, pods):
        self.tmp = tmp
        self.docs, self.nodes, self.pods = docs, nodes, pods
        self.net = Net(list(self.nodes))
        self.procs: dict[str, subprocess.Popen] = {}
        self.shm = Path(f"/dev/shm/pdmesh-k8s-{os.getpid()}")
        try:
            self.setup()
        except BaseException:
            self.stop()
            raise

    def setup(self) -> None:
        addr = self.net.addr
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in dns(self.docs, self.pods, addr).items())
        for n in self.nodes:
            self.net.etc(n, "hosts", hosts)
        # The operator's part: the Secrets (README) and the model on its claim.
        self.tls = self.tmp / "mesh-tls"
        subprocess.run([str(K8S / "make-mesh-tls.sh"), str(self.tls)], check=True, capture_output=True)
        self.models = self.tmp / "models"
        self.models.mkdir(parents=True)
        cached = Path(os.environ.get("PDMESH_MODEL") or
                      Path(os.environ.get("PDMESH_CACHE_DIR") or Path.home() / ".cache" / "pdmesh") / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
        try:
            os.link(cached, self.models / cached.name)
        except OSError:
            shutil.copy(cached, self.models / cached.name)
        maps = {d["metadata"]["name"]: d.get("data", {}) for d in self.docs if d["kind"] == "ConfigMap"}
        for p in self.pods:
            spec = p["spec"]
            vols = {v["name"]: self.volume(p, v) for v in spec["volumes"]}
            for c in spec.get("initContainers", []):
                r = subprocess.run(self.argv(p, c, vols, maps)[0], env=self.argv(p, c, vols, maps)[1],
                                   capture_output=True, text=True, timeout=120)
                assert r.returncode == 0, f"{p['name']} init container {c['name']}: {r.stdout}{r.stderr}"
            for c in spec["containers"]:
                argv, env = self.argv(p, c, vols, maps)
                log = open(self.tmp / f"{p['name']}.{c['name']}.log", "ab")
                self.procs[f"{p['name']}/{c['name']}"] = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.wait_ready()

    def volume(self, pod: dict, v: dict) -> Path:
        if "emptyDir" in v:
            d = self.tmp / "pods" / pod["name"] / v["name"]
        elif "hostPath" in v and v["hostPath"]["path"] != "/dev/shm":
            # A node folder its provisioning made for the pods' user, mode 0700 (the disk
            # tier's, cache-disk.yaml), kept on disk.
            d = self.tmp / "nodes" / pod["node"] / v["hostPath"]["path"].strip("/").replace("/", "_")
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
            return d
        elif "hostPath" in v:
            # The node's own /dev/shm, shared by its pods, on tmpfs.
            d = self.shm / pod["node"] / v["hostPath"]["path"].strip("/").replace("/", "_")
        elif "secret" in v:
            role = v["secret"]["secretName"].removeprefix("pdmesh-mesh-tls-")
            assert role in ("gateway", "tokenizer", "worker", "cache"), v
            return self.tls / role
        elif "persistentVolumeClaim" in v:
            assert v["persistentVolumeClaim"]["claimName"] == "pdmesh-models", v
            return self.models
        else:
            pytest.fail(f"{pod['name']}: a volume this test cannot give: {v}", pytrace=False)
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o1777 if "hostPath" in v else 0o700)
        return d

    def argv(self, pod: dict, c: dict, vols: dict, maps: dict) -> tuple[list[str], dict]:
        assert "command" not in c and re.match(r"^pdmesh:", c["image"]), (pod["name"], c)
        node_ip = self.net.addr[pod["node"]]
        env: dict[str, str] = {}
        for src in c.get("envFrom", []):
            env.update(maps[src["configMapRef"]["name"]])
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") in ("status.hostIP", "status.podIP"):
                env[e["name"]] = node_ip
            elif e["valueFrom"].get("secretKeyRef", {}).get("name") == "pdmesh-api-key":
                env[e["name"]] = API_KEY
            else:
                pytest.fail(f"{pod['name']}: an env source this test cannot give: {e}", pytrace=False)
        mounts = sorted(((m["mountPath"], vols[m["name"]]) for m in c.get("volumeMounts", [])), key=lambda m: -len(m[0]))

        # One pass over every mount, longest first, so a rewritten path is not rewritten
        # again (a directory here may itself start with /tmp).
        where = dict(mounts)
        under = re.compile(r"(?<![\w/])(" + "|".join(re.escape(m) for m, _ in mounts) + r")(?=/|$)") if mounts else None

        def local(s: str) -> str:
            s = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), s)
            return under.sub(lambda m: str(where[m.group(1)]), s) if under else s

        args = [local(a) for a in c["args"]]
        args = ["--device=cpu" if a == "--device=cuda" else a for a in args]
        env = {k: local(v) for k, v in env.items()}
        env |= {"PATH": os.environ["PATH"], "HOME": str(self.tmp / "pods" / pod["name"]), "RUST_LOG": "info"}
        return self.net.exec_argv(pod["node"], [str(pdmesh_bin()), *args]), env

    def probe(self, pod: dict, c: dict, probe: dict) -> bool:
        """One probe, from the pod's node, as the kubelet makes it."""
        a = self.net.addr[pod["node"]]
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        port = lambda x: ports[x] if isinstance(x, str) else x  # noqa: E731
        if "httpGet" in probe:
            url = f"http://{a}:{port(probe['httpGet']['port'])}{probe['httpGet']['path']}"
            with self.net.threads(pod["node"], 1) as ex:
                try:
                    status, _ = ex.submit(http, "GET", url, None, {}, 5).result()
                except OSError:
                    return False
            return 200 <= status < 400
        if "grpc" in probe:
            service = probe["grpc"].get("service", "").encode()
            request = (b"\x0a" + bytes([len(service)]) + service).hex() if service else ""
            r = subprocess.run(self.net.exec_argv(pod["node"], [
                sys.executable, PROBE, f"{a}:{port(probe['grpc']['port'])}", "/grpc.health.v1.Health/Check",
                "--request-hex", request, "--show"]), capture_output=True, text=True, timeout=30)
            # HealthCheckResponse{status: SERVING}
            return r.stdout.split() == ["ok", "0801"]
        if "tcpSocket" in probe:
            try:
                self.net.connect_seconds(pod["node"], a, port(probe["tcpSocket"]["port"]))
                return True
            except OSError:
                return False
        pytest.fail(f"{pod['name']}: a probe this test cannot make: {probe}", pytrace=False)

    def wait_ready(self) -> None:
        waiting = [(p, c) for p in self.pods for c in p["spec"]["containers"] if "readinessProbe" in c]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while waiting:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.logs()}"
            waiting = [(p, c) for p, c in waiting if not self.probe(p, c, c["readinessProbe"])]
            if waiting and time.monotonic() > deadline:
                pytest.fail(f"not ready: {[p['name'] for p, _ in waiting]}\n{self.logs()}", pytrace=False)
            time.sleep(0.5)

    def pod(self, workload: str) -> dict:
        return the_pod(self.pods, workload)

    def gateway(self) -> str:
        svc = next(d for d in self.docs if d["kind"] == "Service" and d["metadata"]["name"] == "pdmesh-gateway")
        return f"http://{self.net.addr[self.pod('pdmesh-gateway')['node']]}:{svc['spec']['ports'][0]['port']}"

    def http(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        with self.net.threads(self.pod("pdmesh-gateway")["node"], 1) as ex:
            return ex.submit(http, method, self.gateway() + path, json.dumps(body).encode() if body else None,
                             {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}, 120).result()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        stop_procs(self.procs.values(), timeout=40)
        self.net.remove()
        shutil.rmtree(self.shm, ignore_errors=True)


def the_pod(pods, workload: str) -> dict:
    [p] = [p for p in pods if p["workload"]["metadata"]["name"] == workload and p["workload"]["kind"] != "DaemonSet"]
    return p


QUESTION = [{"role": "user", "content": "Name the three primary colours of light, then explain why the sky is blue."}]


def test_the_gpu_overlays_topology_serves_the_single_host_answer_across_its_nodes(tmp_path, client, mesh):
    docs = render("gpu-pd")
    nodes = nodes_of(docs)
    pods = schedule(docs, nodes)
    placed = {p["name"]: p["node"] for p in pods}
    print("placed:", placed)
    # The topology: prefill and decode on their own GPU nodes, a cache service on every
    # node a worker is on (they map its mirror), the gateway and tokenizer on the plain
    # node.
    prefill, decode = the_pod(pods, "pdmesh-prefill")["node"], the_pod(pods, "pdmesh-decode")["node"]
    assert (prefill, decode) == ("prefill", "decode"), placed
    assert placed["pdmesh-gateway"] == placed["pdmesh-tokenizer"] == "plain", placed
    caches = {p["node"] for p in pods if p["workload"]["metadata"]["name"] == "pdmesh-cache"}
    assert caches >= {prefill, decode}, f"a worker's node has no cache service: {placed}"

    c = Cluster(tmp_path / "cluster", docs, nodes, pods)
    try:
        status, body = c.http("POST", "/v1/chat/completions", {
            "model": mesh.model, "messages": QUESTION, "max_tokens": 48, "temperature": 0})
        assert status == 200, body
        got = json.loads(body)
        ref = client.chat.completions.create(model=mesh.model, messages=QUESTION, max_tokens=48, temperature=0)
        assert got["choices"][0]["message"]["content"] == ref.choices[0].message.content
        assert got["usage"]["completion_tokens"] == ref.usage.completion_tokens

        # The hand-over was verified, and its pages crossed from the prefill node's cache
        # service to the decode node's.
        status, body = c.http("GET", "/metrics")
        assert status == 200
        m = {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2]) for ln in body.decode().splitlines()
             if ln and not ln.startswith("#")}
        assert m['mesh_kv_transfers_total{outcome="ok"}'] >= 1, m
        assert m['mesh_kv_transfers_total{outcome="failed"}'] == 0, m
        # The gateway is given no cache service: it follows those the workers name as
        # their homes (their nodes' addresses), and reads them all.
        assert m["mesh_caches_read"] == 1, m
        assert m['mesh_kv_peer_bytes_total{direction="received"}'] > 0, json.dumps({k: v for k, v in m.items() if v and ("kv" in k or "hand" in k)})

        # The gateway was given no worker: it found both through DNS.
        log = (c.tmp / "pdmesh-gateway.gateway.log").read_text()
        assert log.count("workers found through DNS") == 2, log[-3000:]

        # The workers' own port speaks only the mesh's mutual TLS; a client holding the
        # mesh's certificate gets in, checking the server for the mesh's one name.
        d = c.pod("pdmesh-decode")
        a = f"{c.net.addr[d['node']]}:50064"
        tls = c.tls
        gw = tls / "gateway"
        mine = ["--ca", str(gw / "ca.crt"), "--cert", str(gw / "tls.crt"), "--key", str(gw / "tls.key"),
                "--server-name", "pdmesh.mesh"]
        for args, want in [(mine, "ok"), ([], "UNAVAILABLE"), (mine[:2], "UNAVAILABLE")]:
            r = subprocess.run(c.net.exec_argv("plain", [sys.executable, PROBE, a, "/pdmesh.worker.v1.Worker/Health", *args]),
                               capture_output=True, text=True, timeout=30)
            assert r.stdout.split()[:1] == [want], (args, r.stdout, r.stderr)
        # A worker's certificate, though the mesh's, may not drive another worker.
        wk = tls / "worker"
        theirs = ["--ca", str(wk / "ca.crt"), "--cert", str(wk / "tls.crt"), "--key", str(wk / "tls.key"),
                  "--server-name", "pdmesh.mesh", "--no-token"]
        r = subprocess.run(c.net.exec_argv("plain", [sys.executable, PROBE, a, "/pdmesh.worker.v1.Worker/Generate", *theirs]),
                           capture_output=True, text=True, timeout=30)
        assert r.stdout.split()[:1] == ["PERMISSION_DENIED"], (r.stdout, r.stderr)
    finally:
        c.stop()
    for name, p in c.procs.items():
        assert p.returncode == 0, f"{name} exited with {p.returncode} at SIGTERM:\n{c.logs()}"
