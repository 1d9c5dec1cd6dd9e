"""deploy/k8s: every overlay renders with `kubectl kustomize`, every object validates
against the Kubernetes API's schemas (kubernetes-validate, strict), and a lint checks what
a platform team would: images pinned, resources requested, probes on every container (on
the workers, the gRPC health service's readiness and liveness), nothing privileged or
root, every flag given to `pdmesh` one its `--help` lists, every Service port one its pods
listen on, and the GPU overlay's workers on GPU nodes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from conftest import pdmesh_bin

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu-pd"]
IMAGE = re.compile(r"^pdmesh:\d+\.\d+\.\d+$")
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}


def kubectl() -> str:
    """`$KUBECTL`, target/tools/kubectl (tests/run-all puts Debian's there), or PATH's."""
    for c in (os.environ.get("KUBECTL"), str(K8S.parents[1] / "target" / "tools" / "kubectl"), shutil.which("kubectl")):
        if c and Path(c).is_file():
            return c
    pytest.fail("kubectl not found: tests/run-all installs it (Debian's kubernetes-client)", pytrace=False)


@cache
def render(overlay: str) -> tuple[dict, ...]:
    r = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def pods(docs) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every workload."""
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in WORKLOADS]


@cache
def help_flags(sub: str) -> frozenset[str]:
    cmd = [str(pdmesh_bin()), *sub.split(), "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", out))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert kinds >= {"Deployment", "StatefulSet", "DaemonSet", "Service", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "NetworkPolicy"}, kinds
    version = kubernetes_validate.utils.latest_version()
    for d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{d['kind']} {d['metadata']['name']}: {e.message} at {list(e.path)}", pytrace=False)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lint_images_resources_probes_and_security(overlay):
    for w, spec in pods(render(overlay)):
        name = w["metadata"]["name"]
        # The NetworkPolicy lets in only the mesh's own pods, known by this label.
        assert w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/part-of") == "pdmesh", name
        sc = spec.get("securityContext", {})
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0, name
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), name
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{c['name']}"
            assert IMAGE.match(c["image"]), f"{where}: image not pinned to a version: {c['image']}"
            req = c.get("resources", {}).get("requests", {})
            assert "cpu" in req and "memory" in req, f"{where}: no cpu and memory requests"
            assert "memory" in c["resources"].get("limits", {}), f"{where}: no memory limit"
            csc = c.get("securityContext", {})
            assert not csc.get("privileged") and csc.get("allowPrivilegeEscalation") is False, where
            assert csc.get("readOnlyRootFilesystem") is True, where
            assert csc.get("capabilities", {}).get("drop") == ["ALL"], where
            # A read-only root leaves no /tmp: `pdmesh model fetch` downloads there.
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            vols = {v["name"]: v for v in spec["volumes"]}
            assert "emptyDir" in vols.get(mounts.get("/tmp"), {}), f"{where}: no writable /tmp"
        for c in spec["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, f"{name}/{c['name']}: probes missing"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_probe_grpc_health_and_the_gateway_and_workers_drain_inside_their_grace(overlay):
    workers = [(w, s) for w, s in pods(render(overlay)) if w["kind"] == "StatefulSet"]
    assert {w["metadata"]["name"] for w, _ in workers} == {"pdmesh-prefill", "pdmesh-decode"}
    for w, spec in workers:
        [c] = spec["containers"]
        assert c["readinessProbe"]["grpc"] == {"port": 50064, "service": "readiness"}, c["readinessProbe"]
        assert c["livenessProbe"]["grpc"] == {"port": 50064, "service": "liveness"}, c["livenessProbe"]
    # The gateway and the workers drain at SIGTERM, inside their grace period.
    for w, spec in pods(render(overlay)):
        if w["metadata"]["name"] not in ("pdmesh-gateway", "pdmesh-prefill", "pdmesh-decode"):
            continue
        [c] = spec["containers"]
        drain = next(int(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--drain-timeout-ms="))
        assert drain / 1000 < spec["terminationGracePeriodSeconds"], (w["metadata"]["name"], drain)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_given_to_pdmesh_exists_in_its_help(overlay):
    for w, spec in pods(render(overlay)):
        for c in spec.get("initContainers", []) + spec["containers"]:
            args = c["args"]
            sub = " ".join(a for a in args[:2] if not a.startswith("-"))
            flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
            unknown = flags - help_flags(sub)
            assert not unknown, f"{w['metadata']['name']}/{c['name']}: `pdmesh {sub}` has no {sorted(unknown)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_port_is_one_its_pods_listen_on(overlay):
    docs = render(overlay)
    for svc in (d for d in docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        targets = [s for w, s in pods(docs)
                   if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
        assert targets, f"Service {svc['metadata']['name']} selects no pods"
        for p in svc["spec"]["ports"]:
            for spec in targets:
                ports = [cp for c in spec["containers"] for cp in c.get("ports", [])]
                names = {cp.get("name") for cp in ports}
                numbers = {cp["containerPort"] for cp in ports}
                t = p["targetPort"]
                assert (t in names) if isinstance(t, str) else (t in numbers), (svc["metadata"]["name"], p, ports)
                # The named port is the one the process is told to listen on.
                [num] = [cp["containerPort"] for cp in ports if cp.get("name") == t or cp["containerPort"] == t]
                args = " ".join(a for c in spec["containers"] for a in c["args"])
                assert f"--listen=0.0.0.0:{num}" in args, (svc["metadata"]["name"], num, args)


def test_the_gpu_overlay_puts_prefill_and_decode_on_separate_gpu_pools():
    workers = {w["metadata"]["name"]: s for w, s in pods(render("gpu-pd")) if w["kind"] == "StatefulSet"}
    pools = set()
    for name, spec in workers.items():
        [c] = spec["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert "--device=cuda" in c["args"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), name
        pools.add(spec["nodeSelector"]["pdmesh.io/pool"])
    assert pools == {"prefill", "decode"}
    # The CPU overlay asks for no GPU anywhere.
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(render("cpu"))
