"""deploy/k8s: every overlay renders with `kubectl kustomize`, every object validates
against the Kubernetes API's schemas (kubernetes-validate, strict), and a lint checks what
a platform team would: images pinned, resources requested, probes on every container (on
the workers, the gRPC health service's readiness and liveness), nothing privileged or
root, every flag given to `pdmesh` one its `--help` lists, every Service port one its pods
listen on, and the GPU overlay's workers on GPU nodes. Custom resources (LeaderWorkerSet,
ServiceMonitor) validate against schemas of their published APIs kept in schemas/, their
pod templates and metadata against Kubernetes' own; the dashboards and alert rules ship
as ConfigMaps holding the very files the compose stack uses; every service speaks the
mesh's mutual TLS from one Secret."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import copy
import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import pdmesh_bin

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu-pd"]
IMAGE = re.compile(r"^pdmesh:\d+\.\d+\.\d+$")
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "LeaderWorkerSet"}
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# Custom resources and the schema each validates against (the rest are Kubernetes' own).
CRDS = {"LeaderWorkerSet": "leaderworkerset.v1.json", "ServiceMonitor": "servicemonitor.v1.json"}
# Secrets the operator creates (deploy/k8s/README.md says how); the manifests only name them.
# The API key, and one mesh TLS Secret per role (its certificate's subject names the role).
ROLE_OF = {"gateway": "gateway", "tokenizer": "tokenizer", "cache": "cache", "prefill": "worker", "decode": "worker"}
SECRETS = {"pdmesh-api-key", *(f"pdmesh-mesh-tls-{r}" for r in set(ROLE_OF.values()))}
# Environment variables pdmesh reads that no flag names, and the source that reads them.
OUTSIDE_FLAGS_SOURCE = {"PDMESH_CACHE_DIR": "crates/gguf/src/models.rs"}
OUTSIDE_FLAGS = frozenset(n for n, src in OUTSIDE_FLAGS_SOURCE.items() if f'"{n}"' in (REPO / src).read_text())
# kubectl apply (client side) keeps the object in an annotation of at most 256 KiB.
APPLY_ANNOTATION_LIMIT = 262144


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


def templates(d: dict) -> list[dict]:
    """A workload's pod templates: a LeaderWorkerSet's worker and leader templates."""
    if d["kind"] == "LeaderWorkerSet":
        lwt = d["spec"]["leaderWorkerTemplate"]
        return [lwt["workerTemplate"], *([lwt["leaderTemplate"]] if "leaderTemplate" in lwt else [])]
    return [d["spec"]["template"]]


def pods(docs) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every workload's every pod template."""
    return [(d, t["spec"]) for d in docs if d["kind"] in WORKLOADS for t in templates(d)]


def pod_labels(w: dict) -> list[dict]:
    return [t["metadata"]["labels"] for t in templates(w)]


def validate_builtin(d: dict) -> None:
    try:
        kubernetes_validate.validate(d, kubernetes_validate.utils.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as e:
        name = d.get("metadata", {}).get("name", "?")
        pytest.fail(f"{d['kind']} {name}: {e.message} at {list(e.path)}", pytrace=False)


@cache
def crd_schema(kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / CRDS[kind]).read_text()))


def crd_errors(d: dict) -> list[str]:
    """What the custom resource's schema, and Kubernetes' own for its metadata and pod
    templates, find wrong with `d`."""
    errors = [f"{list(e.path)}: {e.message}" for e in crd_schema(d["kind"]).iter_errors(d)]
    version = kubernetes_validate.utils.latest_version()
    name = d.get("metadata", {}).get("name", "x")
    wrapped = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": d["metadata"]}]
    if d["kind"] in WORKLOADS and not errors:
        wrapped += [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": t}
                    for t in templates(d)]
    for w in wrapped:
        try:
            kubernetes_validate.validate(w, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{w['kind']} {list(e.path)}: {e.message}")
    return errors


@cache
def help_env(sub: str) -> frozenset[str]:
    cmd = [str(pdmesh_bin()), *sub.split(), "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return frozenset(re.findall(r"\[env: ([A-Z0-9_]+)[=\]]", out)) | OUTSIDE_FLAGS


@cache
def help_flags(sub: str) -> frozenset[str]:
    cmd = [str(pdmesh_bin()), *sub.split(), "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", out))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert kinds >= {"Deployment", "DaemonSet", "Service", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "NetworkPolicy", "ConfigMap"}, kinds
    # The CPU overlay needs nothing installed beyond Kubernetes; the GPU overlay runs its
    # workers as LeaderWorkerSets and is scraped through a ServiceMonitor.
    workers = {d["kind"] for d in docs if d["metadata"]["name"] in ("pdmesh-prefill", "pdmesh-decode")
               and d["kind"] in WORKLOADS}
    assert workers == ({"StatefulSet"} if overlay == "cpu" else {"LeaderWorkerSet"}), workers
    assert (kinds & set(CRDS)) == (set() if overlay == "cpu" else set(CRDS)), kinds
    for d in docs:
        if d["kind"] in CRDS:
            errors = crd_errors(d)
            assert not errors, f"{d['kind']} {d['metadata']['name']}: {errors}"
        else:
            validate_builtin(d)


def test_the_custom_resource_schemas_refuse_what_their_apis_refuse():
    """The schemas are strict: the GPU overlay's objects pass, and each mistake below, of
    the kind a hand-edited manifest makes, fails."""
    docs = {d["kind"]: d for d in render("gpu-pd") if d["kind"] in CRDS}
    lws, sm = docs["LeaderWorkerSet"], docs["ServiceMonitor"]
    assert not crd_errors(lws) and not crd_errors(sm)

    def broken(d, path, value):
        out = at = copy.deepcopy(d)
        *parents, last = path
        for p in parents:
            at = at[p]
        at[last] = value
        return out

    lwt = ["spec", "leaderWorkerTemplate"]
    wrong = [
        broken(lws, ["spec", "replica"], 1),  # a misspelt field
        broken(lws, ["spec", "startupPolicy"], "LeaderStarted"),
        broken(lws, [*lwt, "restartPolicy"], "Always"),
        broken(lws, [*lwt, "size"], "1"),
        broken(lws, ["spec", "rolloutStrategy", "rollingUpdateConfiguration", "maxSurge"], "one"),
        broken(lws, [*lwt, "workerTemplate", "spec", "containers", 0, "ports", 0, "containerPort"], "grpc"),
        broken(lws, [*lwt, "workerTemplate", "spec", "containers", 0, "arg"], ["decode"]),
        broken(lws, ["apiVersion"], "leaderworkerset.x-k8s.io/v1beta1"),
        broken(sm, ["spec", "endpoints", 0, "interval"], "5 seconds"),
        broken(sm, ["spec", "endpoints", 0, "scheme"], "grpc"),
        broken(sm, ["spec", "endpoints", 0, "pathh"], "/metrics"),
        broken(sm, ["spec", "endpoints", 0, "port"], 8080),
        broken(sm, ["spec", "selector"], {"matchLabel": {"a": "b"}}),
        broken(sm, ["metadata", "labels"], {"app": 5}),
    ]
    for d in wrong:
        assert crd_errors(d), f"accepted: {json.dumps(d)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lint_images_resources_probes_and_security(overlay):
    for w, spec in pods(render(overlay)):
        name = w["metadata"]["name"]
        # The NetworkPolicy lets in only the mesh's own pods, known by this label.
        assert all(lab.get("app.kubernetes.io/part-of") == "pdmesh" for lab in pod_labels(w)), name
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
    workers = [(w, s) for w, s in pods(render(overlay)) if w["metadata"]["name"] in ("pdmesh-prefill", "pdmesh-decode")]
    assert sorted(w["metadata"]["name"] for w, _ in workers) == ["pdmesh-decode", "pdmesh-prefill"]
    for w, spec in workers:
        [c] = spec["containers"]
        # The kubelet's gRPC probes speak no TLS: they ask the plaintext health port.
        assert "--health-listen=0.0.0.0:50065" in c["args"], c["args"]
        assert {"name": "health", "containerPort": 50065} in c["ports"], c["ports"]
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": 50065, "service": "readiness"}, c[probe]
        assert c["livenessProbe"]["grpc"] == {"port": 50065, "service": "liveness"}, c["livenessProbe"]
    # The gateway and the workers drain at SIGTERM, after any preStop sleep, inside their
    # grace period; the gateway sleeps first while the endpoints drop it.
    for w, spec in pods(render(overlay)):
        if w["metadata"]["name"] not in ("pdmesh-gateway", "pdmesh-prefill", "pdmesh-decode", "pdmesh-cache"):
            continue
        [c] = spec["containers"]
        drain = next(int(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--drain-timeout-ms="))
        pre = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pre + drain / 1000 < spec["terminationGracePeriodSeconds"], (w["metadata"]["name"], pre, drain)
        if w["metadata"]["name"] in ("pdmesh-prefill", "pdmesh-decode"):
            # Longer than the gateways' DNS look-up interval (--discovery-interval-ms,
            # 5 s by default): they stop routing to it before it starts refusing.
            assert pre > 5, c.get("lifecycle")
        if w["metadata"]["name"] == "pdmesh-gateway":
            assert pre >= 5, c.get("lifecycle")
            # Ready while it can serve, not only while every worker is up (a rolling
            # update of workers must leave the gateways in their Service).
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready", c["readinessProbe"]
            # /ready asks the backends for up to 3 s (BACKEND_PROBE_TIMEOUT): the probe
            # waits longer than that.
            assert c["readinessProbe"]["timeoutSeconds"] > 3, c["readinessProbe"]
            # Liveness asks no backend: a hung worker must not restart the gateway.
            assert c["livenessProbe"]["httpGet"]["path"] == "/live", c["livenessProbe"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_mirror_and_incident_reports_stay_private_to_the_pods_user(overlay):
    """The cache service keeps the host mirror in a 0700 directory of its own user under
    the node's /dev/shm, so every pod that maps it must run as that user; and a service
    refuses a world-writable incident directory (what an emptyDir is), so reports go into
    a subdirectory of the mount, which the service creates owner-only."""
    users = {}
    for w, spec in pods(render(overlay)):
        name = w["metadata"]["name"]
        sc = spec["securityContext"]
        vols = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            mounts = {m["mountPath"]: vols[m["name"]] for m in c.get("volumeMounts", [])}
            if "/dev/shm" in mounts and "hostPath" in mounts["/dev/shm"]:
                users[f"{name}/{c['name']}"] = (sc["runAsUser"], sc["runAsGroup"])
            for a in c.get("args", []):
                if a.startswith("--incident-dir="):
                    d = a.split("=", 1)[1]
                    assert d not in mounts, f"{name}: --incident-dir is the mount {d} itself, not a directory inside it"
                    assert any(d.startswith(m.rstrip("/") + "/") for m in mounts), f"{name}: {d} is on no volume"
    assert any(k.startswith("pdmesh-cache/") for k in users), users
    assert len(set(users.values())) == 1, f"the pods mapping the mirror run as different users: {users}"


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
        targets = [t["spec"] for w in docs if w["kind"] in WORKLOADS for t in templates(w)
                   if all(t["metadata"]["labels"].get(k) == v for k, v in sel.items())]
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
    workers = {w["metadata"]["name"]: s for w, s in pods(render("gpu-pd")) if w["kind"] == "LeaderWorkerSet"}
    assert sorted(workers) == ["pdmesh-decode", "pdmesh-prefill"]
    for w in (d for d in render("gpu-pd") if d["kind"] == "LeaderWorkerSet"):
        # One group per tensor-parallel set: the ranks are one process, so one pod.
        assert w["spec"]["leaderWorkerTemplate"]["size"] == 1, w["metadata"]["name"]
    # Nothing of the base's StatefulSets or their Services is left to clash with the LWS
    # controller's headless Services of the same names.
    assert not [d for d in render("gpu-pd") if d["kind"] in ("StatefulSet", "Service")
                and d["metadata"]["name"] in ("pdmesh-prefill", "pdmesh-decode")]
    pools = set()
    for name, spec in workers.items():
        [c] = spec["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert "--device=cuda" in c["args"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), name
        pools.add(spec["nodeSelector"]["pdmesh.io/pool"])
    assert pools == {"prefill", "decode"}
    # The CPU overlay asks for no GPU anywhere (the cache service only tolerates GPU
    # nodes' taint: it must run wherever workers do).
    for w, spec in pods(render("cpu")):
        for c in spec["containers"]:
            assert "nvidia.com/gpu" not in yaml.safe_dump(c.get("resources", {})), w["metadata"]["name"]
    [cache] = [s for w, s in pods(render("gpu-pd")) if w["kind"] == "DaemonSet"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in cache["tolerations"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_env_var_is_one_pdmesh_reads_and_every_reference_resolves(overlay):
    docs = render(overlay)
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for w, spec in pods(docs):
        vols = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            where = f"{w['metadata']['name']}/{c['name']}"
            names = {e["name"] for e in c.get("env", [])}
            for src in c.get("envFrom", []):
                ref = src["configMapRef"]["name"]
                assert ref in maps, f"{where}: ConfigMap {ref} is not in the overlay"
                names |= set(maps[ref]["data"])
            sub = " ".join(a for a in c["args"][:2] if not a.startswith("-"))
            unread = {n for n in names if n.startswith("PDMESH_")} - help_env(sub)
            assert not unread, f"{where}: `pdmesh {sub}` reads no {sorted(unread)}"
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef", {}).get("name")
                assert ref is None or ref in SECRETS, f"{where}: unknown Secret {ref}"
        for v in vols.values():
            if "secret" in v:
                assert v["secret"]["secretName"] in SECRETS, v
    readme = (K8S / "README.md").read_text()
    for secret in SECRETS:
        assert secret in readme, f"deploy/k8s/README.md does not say how to make {secret}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_mesh_service_speaks_the_meshs_mutual_tls_from_its_secret(overlay):
    docs = render(overlay)
    tls = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pdmesh-mesh-tls")["data"]
    assert tls["PDMESH_TLS_SERVER_NAME"] == "pdmesh.mesh", tls
    services = set()
    for w, spec in pods(docs):
        vols = {v["name"]: v for v in spec["volumes"]}
        [c] = spec["containers"]
        services.add(c["args"][0])
        where = f"{w['metadata']['name']}/{c['name']}"
        assert {"configMapRef": {"name": "pdmesh-mesh-tls"}} in c.get("envFrom", []), where
        # Its own role's certificate, no other's.
        mounts = [m for m in c["volumeMounts"] if "secret" in vols[m["name"]]
                  and vols[m["name"]]["secret"]["secretName"].startswith("pdmesh-mesh-tls")]
        assert [vols[m["name"]]["secret"]["secretName"] for m in mounts] == [f"pdmesh-mesh-tls-{ROLE_OF[c['args'][0]]}"], where
        assert len(mounts) == 1 and mounts[0].get("readOnly") is True, where
        for key in ("PDMESH_TLS_CA", "PDMESH_TLS_CERT", "PDMESH_TLS_KEY"):
            assert Path(tls[key]).parent == Path(mounts[0]["mountPath"]), (where, key, tls[key])
        # Group-readable only: the pods run as group 10001 (fsGroup).
        assert vols[mounts[0]["name"]]["secret"]["defaultMode"] == 0o440, where
        assert spec["securityContext"]["fsGroup"] == 10001, where
    assert services == {"gateway", "tokenizer", "cache", "prefill", "decode"}, services


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_dashboards_and_alert_rules_ship_as_configmaps_of_the_committed_files(overlay):
    maps = {d["metadata"]["name"]: d for d in render(overlay) if d["kind"] == "ConfigMap"}
    boards = maps["pdmesh-dashboards"]
    # Grafana's sidecar loads ConfigMaps with this label.
    assert boards["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(p.name for p in (REPO / "dashboards").glob("*.json"))
    assert sorted(boards["data"]) == files and len(files) == 5
    for name in files:
        assert boards["data"][name] == (REPO / "dashboards" / name).read_text(), name
    rules = maps["pdmesh-prometheus-rules"]["data"]
    # The rules, not their promtool tests (which would stop Prometheus from starting).
    assert list(rules) == ["pdmesh.rules.yml"]
    assert rules["pdmesh.rules.yml"] == (REPO / "deploy" / "prometheus" / "rules" / "pdmesh.rules.yml").read_text()
    for m in maps.values():
        assert len(json.dumps(m)) < APPLY_ANNOTATION_LIMIT, f"{m['metadata']['name']} is too big for kubectl apply"


def test_the_service_monitor_scrapes_the_gateways_metrics_port():
    docs = render("gpu-pd")
    [sm] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    sel = sm["spec"]["selector"]["matchLabels"]
    [svc] = [d for d in docs if d["kind"] == "Service"
             and all(d["metadata"].get("labels", {}).get(k) == v for k, v in sel.items())]
    assert svc["metadata"]["name"] == "pdmesh-gateway"
    [ep] = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["path"] == "/metrics"
    # The same port and path the pods' scrape annotations give.
    [gw] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdmesh-gateway"]
    ann = gw["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/path"] == ep["path"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_finds_the_ready_workers_through_headless_services(overlay):
    docs = render(overlay)
    [gw] = [s for w, s in pods(docs) if w["metadata"]["name"] == "pdmesh-gateway"]
    args = gw["containers"][0]["args"]
    # No worker is listed by name: scaling a StatefulSet or LeaderWorkerSet needs no
    # change to the gateway.
    assert not [a for a in args if a.startswith(("--prefill-url", "--decode-url"))], args
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for side in ("prefill", "decode"):
        [name] = [a.split("=", 1)[1] for a in args if a.startswith(f"--{side}-dns=")]
        host, port = name.rsplit(":", 1)
        svc = services[host]
        # Headless (the name resolves to the pods) and ready pods only.
        assert svc["spec"]["clusterIP"] == "None", svc
        assert not svc["spec"].get("publishNotReadyAddresses"), svc
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": f"pdmesh-{side}"}, svc
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]], svc
