"""Static checks of the docker-compose deployment under deploy/: nothing here needs a
Docker engine. The compose file, the Prometheus, Grafana, collector and Tempo configs
and the Dockerfile are parsed and checked against each other and against the built
`pdmesh` binary ($PDMESH_BIN), whose command-line parser validates every mesh service's
command (each one is run with `--help` appended: clap checks every flag and value
before it prints the help, and exits non-zero on any it does not accept).
"""

from __future__ import annotations

import fnmatch
import functools
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from conftest import REPO, pdmesh_bin

DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"

MESH = ("cache", "tokenizer", "prefill", "decode", "gateway")
SERVICES = {"model", *MESH, "prometheus", "grafana", "otel-collector", "tempo"}
# pdmesh's service subcommands (`pdmesh serve <service>` is the same command).
SERVICE_SUBCOMMANDS = {"tokenizer", "worker", "prefill", "decode", "gateway", "cache"}
# Environment variables pdmesh reads outside clap (so they are not in `--help`).
# Read by the code directly rather than as a flag's variable (the mesh token has no flag:
# it must never be on a command line).
LIBRARY_ENV = {"PDMESH_CACHE_DIR", "PDMESH_PYTHON", "PDMESH_MESH_TOKEN"}
DEFAULT_PORTS = {"prometheus": 9090, "grafana": 3000}


def load_yaml(path: Path):
    with path.open() as f:
        return yaml.safe_load(f)


@functools.cache
def compose() -> dict:
    return load_yaml(COMPOSE_FILE)


def services() -> dict:
    return compose()["services"]


def command(name: str) -> list[str]:
    cmd = services()[name].get("command")
    assert isinstance(cmd, list), f"{name}: write `command` as a list, not a shell string"
    return [str(a) for a in cmd]


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` (the last one wins, as in clap)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def flag_values(args: list[str], flag: str) -> list[str]:
    out = []
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def environment(name: str) -> dict[str, str]:
    env = services()[name].get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {str(k): str(v) for k, v in env.items()}


def subcommand(args: list[str]) -> list[str]:
    """The pdmesh subcommand words at the start of `args` (`serve X` is `X`)."""
    if args[:1] == ["serve"]:
        return args[:2]
    if args[:1] == ["model"]:
        return args[:2]
    return args[:1]


def mounts(name: str) -> list[tuple[str, str, str]]:
    """(kind, source, target) of a service's volumes; kind is "bind" (a repository path),
    "volume", or "host" (a host path chosen by a variable, with a default)."""
    out = []
    for v in services()[name].get("volumes") or []:
        if isinstance(v, dict):
            kind = v.get("type", "volume")
            out.append((kind, str(v.get("source", "")), str(v["target"])))
            continue
        v = str(v)
        # A host path the user picks: ${VAR:-default}:TARGET[:MODE].
        chosen = re.match(r"(\$\{[A-Z0-9_]+:-[^}]*\}):(.*)$", v)
        if chosen:
            parts = [chosen.group(1), *chosen.group(2).split(":")]
        else:
            parts = v.split(":")
        assert len(parts) in (2, 3), f"{name}: volume {v!r} is not SOURCE:TARGET[:MODE]"
        source, target = parts[0], parts[1]
        if chosen:
            kind = "host"
        else:
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        out.append((kind, source, target))
    return out


def mount_target(name: str, host_path: Path) -> str:
    """Where `name` mounts the repository path `host_path`."""
    for kind, source, target in mounts(name):
        if kind == "bind" and (DEPLOY / source).resolve() == host_path.resolve():
            return target
    pytest.fail(f"{name} does not mount {host_path.relative_to(REPO)}")


def hostport(addr: str) -> tuple[str, int]:
    """host and port of `host:port` or a URL."""
    if "://" not in addr:
        addr = "tcp://" + addr
    u = urlsplit(addr)
    assert u.hostname and u.port, f"{addr!r} has no host:port"
    return u.hostname, u.port


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def endpoint_ports(tree) -> set[int]:
    """Every port in an `endpoint: host:port` anywhere under `tree`."""
    ports = set()
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == "endpoint" and isinstance(v, str) and ":" in v:
                ports.add(port_of(v))
            else:
                ports |= endpoint_ports(v)
    elif isinstance(tree, list):
        for v in tree:
            ports |= endpoint_ports(v)
    return ports


def tempo_config() -> dict:
    return load_yaml(DEPLOY / "tempo" / "tempo.yaml")


def collector_config() -> dict:
    return load_yaml(DEPLOY / "otel" / "collector.yaml")


def listen_addresses(name: str) -> list[str]:
    """host:port addresses service `name` listens on inside the compose network."""
    if name in MESH:
        args = command(name)
        listen = flag_value(args, "--listen") or environment(name).get("PDMESH_LISTEN")
        return [listen] if listen else []
    if name == "tempo":
        cfg = tempo_config()
        return [f"0.0.0.0:{cfg['server']['http_listen_port']}"] + [
            f"0.0.0.0:{p}" for p in endpoint_ports(cfg["distributor"]["receivers"])
        ]
    if name == "otel-collector":
        return [f"0.0.0.0:{p}" for p in endpoint_ports(collector_config()["receivers"])]
    if name == "prometheus":
        addr = flag_value(command(name), "--web.listen-address")
        return [addr or f"0.0.0.0:{DEFAULT_PORTS[name]}"]
    if name == "grafana":
        port = environment(name).get("GF_SERVER_HTTP_PORT", DEFAULT_PORTS[name])
        return [f"0.0.0.0:{port}"]
    return []


def listen_ports(name: str) -> set[int]:
    return {port_of(a) for a in listen_addresses(name)}


BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
}


def parse_bytes(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(s))
    assert m and m.group(2).lower() in BYTE_UNITS, f"cannot read the size {s!r}"
    return int(m.group(1)) * BYTE_UNITS[m.group(2).lower()]


@functools.cache
def help_text(args: tuple[str, ...], env: tuple[tuple[str, str], ...] = ()) -> str:
    """`pdmesh ARGS --help`: clap validates ARGS (and the PDMESH_* variables in `env`)
    first, so a non-zero exit means the command line would not start."""
    r = subprocess.run(
        [str(pdmesh_bin()), *args, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        # Only the service's own variables: the caller's PDMESH_* must not leak in.
        env={"PATH": "/usr/bin:/bin", **dict(env)},
    )
    assert r.returncode == 0, f"`pdmesh {' '.join(args)}` is refused:\n{r.stderr}{r.stdout}"
    return r.stdout


# --- files ---------------------------------------------------------------------------


def test_every_yaml_file_under_deploy_parses():
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))
    assert COMPOSE_FILE in files
    for p in files:
        with p.open() as f:
            docs = list(yaml.safe_load_all(f))
        assert any(d is not None for d in docs), f"{p.relative_to(REPO)} is empty"


def test_compose_has_the_mesh_and_the_observability_stack():
    missing = SERVICES - set(services())
    assert not missing, f"services missing from docker-compose.yml: {sorted(missing)}"


def test_every_image_is_pinned_to_a_version():
    for name, svc in services().items():
        image = svc.get("image")
        assert image, f"{name} has no image"
        ref = image.split("@", 1)[0].rsplit("/", 1)[-1]
        assert ":" in ref, f"{name}: {image} has no tag"
        tag = ref.split(":", 1)[1]
        assert tag and tag != "latest", f"{name}: {image} is not pinned"
        assert "${" not in image, f"{name}: {image} depends on the environment"


def test_published_ports_bind_loopback_only():
    for name, svc in services().items():
        assert svc.get("network_mode") != "host", f"{name} uses the host network"
        for p in svc.get("ports") or []:
            if isinstance(p, dict):
                assert p.get("host_ip") == "127.0.0.1", f"{name}: {p} is not bound to 127.0.0.1"
                assert p.get("published"), f"{name}: {p} publishes a random port"
                container = int(p["target"])
            else:
                # A host port a variable may move: its default.
                spec = re.sub(r"\$\{[A-Z0-9_]+:?-([0-9]+)\}", r"\1", str(p))
                parts = spec.split("/", 1)[0].split(":")
                assert len(parts) == 3 and parts[0] == "127.0.0.1", (
                    f"{name}: port {p!r} must be 127.0.0.1:HOST:CONTAINER"
                )
                container = int(parts[2])
            assert container in listen_ports(name), (
                f"{name} publishes {container}, but listens on {sorted(listen_ports(name))}"
            )


def test_host_mounts_exist_in_the_repository_and_named_volumes_are_declared():
    declared = set(compose().get("volumes") or {})
    for name in services():
        for kind, source, target in mounts(name):
            if kind == "bind":
                assert source.startswith("."), (
                    f"{name}: {source} must be relative to deploy/, not a machine path"
                )
                path = (DEPLOY / source).resolve()
                assert path.is_relative_to(REPO), f"{name}: {source} leaves the repository"
                assert path.exists(), f"{name} mounts {source}, which does not exist"
            elif kind == "host":
                # A file of the host's own (its CA bundle), with a default that exists on
                # Debian-like hosts.
                default = source.split(":-", 1)[1].rstrip("}")
                assert default.startswith("/etc/"), f"{name}: {source} defaults to {default}"
            else:
                assert source in declared, f"{name}: volume {source!r} is not declared"
    # The files the stack is made of are all mounted.
    for name, path in [
        ("prometheus", DEPLOY / "prometheus" / "prometheus.yml"),
        ("prometheus", DEPLOY / "prometheus" / "rules"),
        ("grafana", DEPLOY / "grafana" / "provisioning"),
        ("grafana", REPO / "dashboards"),
        ("otel-collector", DEPLOY / "otel" / "collector.yaml"),
        ("tempo", DEPLOY / "tempo" / "tempo.yaml"),
    ]:
        mount_target(name, path)
    assert (DEPLOY / "prometheus" / "rules").is_dir()
    assert (REPO / "dashboards").is_dir()


def test_depends_on_names_defined_services_with_conditions_that_can_hold():
    svcs = services()
    for name, svc in svcs.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            assert dep in svcs, f"{name} depends on {dep!r}, which is not a service"
            cond = (spec or {}).get("condition", "service_started")
            assert cond in {"service_started", "service_healthy", "service_completed_successfully"}
            if cond == "service_healthy":
                assert "healthcheck" in svcs[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"
            if cond == "service_completed_successfully":
                assert svcs[dep].get("restart", "no") == "no", f"{dep} is waited for to exit: it must not restart"
        ipc = str(svc.get("ipc", ""))
        if ipc.startswith("service:"):
            donor = ipc.split(":", 1)[1]
            assert donor in svcs, f"{name} joins the IPC namespace of {donor!r}, which is not a service"
            assert svcs[donor].get("ipc") == "shareable", f"{donor} must be `ipc: shareable`"


# --- the mesh services ---------------------------------------------------------------


def test_mesh_commands_use_only_subcommands_and_flags_pdmesh_has():
    for name in ("model", *MESH):
        args = command(name)
        sub = subcommand(args)
        pdmesh_env = {k: v for k, v in environment(name).items() if k.startswith("PDMESH_")}
        # The whole command line, values included, must parse.
        text = help_text(tuple(args), tuple(sorted((k, v) for k, v in pdmesh_env.items() if k not in LIBRARY_ENV)))
        known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text))
        for a in args:
            if a.startswith("--"):
                flag = a.split("=", 1)[0]
                assert flag in known, f"{name}: `pdmesh {' '.join(sub)}` has no {flag}"
        for var in pdmesh_env:
            assert var in LIBRARY_ENV or f"[env: {var}" in text, (
                f"{name}: `pdmesh {' '.join(sub)}` reads no {var}"
            )
        if name == "model":
            assert sub == ["model", "fetch"], f"model runs `pdmesh {' '.join(args)}`"
        else:
            word = sub[-1]
            assert word in SERVICE_SUBCOMMANDS, f"{name} runs `pdmesh {word}`, not a service"


def test_mesh_services_listen_on_all_interfaces_on_distinct_ports():
    seen = {}
    for name in MESH:
        addrs = listen_addresses(name)
        assert addrs, f"{name} sets no --listen: its default is loopback, unreachable from other containers"
        host, port = addrs[0].rsplit(":", 1)
        assert host == "0.0.0.0", f"{name} listens on {addrs[0]}: other containers cannot reach it"
        assert port not in seen, f"{name} and {seen.get(port)} both listen on {port}"
        seen[port] = name


def test_service_urls_name_compose_services_and_their_ports():
    for name in MESH:
        args = command(name)
        for flag in {a.split("=", 1)[0] for a in args if a.startswith("--") and a.split("=", 1)[0].endswith("-url")}:
            for value in flag_values(args, flag):
                for url in value.split(","):
                    host, port = hostport(url)
                    assert host in services(), f"{name} {flag} {url}: {host!r} is not a service"
                    assert port in listen_ports(host), (
                        f"{name} {flag} {url}: {host} listens on {sorted(listen_ports(host))}"
                    )
    gw = command("gateway")
    assert flag_value(gw, "--prefill-url") and flag_value(gw, "--decode-url"), "the gateway must disaggregate"
    assert hostport(flag_value(gw, "--tokenizer-url"))[0] == "tokenizer"


def test_workers_share_the_cache_services_shared_memory():
    """Prefill and decode map the cache service's mirror file (the shm data plane is
    required for disaggregation), so they must see the /dev/shm the file is in."""
    cache_args = command("cache")
    assert flag_value(cache_args, "--shm-dir") == "/dev/shm", (
        "pin the mirror to /dev/shm: the fallback (the cache's own /tmp) is invisible to workers"
    )
    cache = services()["cache"]
    assert cache.get("ipc") == "shareable"
    mirror = flag_value(cache_args, "--host-mirror-size") or "1GiB"
    assert re.fullmatch(r"\d+[KMG]iB", mirror), f"size the mirror in bytes, not {mirror!r}"
    assert "shm_size" in cache, "the default /dev/shm (64 MiB) is smaller than the mirror"
    assert parse_bytes(cache["shm_size"]) > parse_bytes(mirror.replace("iB", "")), (
        f"shm_size {cache['shm_size']} does not hold the {mirror} mirror"
    )
    for name in ("prefill", "decode"):
        args = command(name)
        cache_url = flag_value(args, "--cache-url")
        assert cache_url, f"{name} needs --cache-url"
        host, _ = hostport(cache_url)
        assert host == "cache"
        assert services()[name].get("ipc") == f"service:{host}", (
            f"{name} must join the cache's IPC namespace (ipc: service:{host}) to map its /dev/shm"
        )
        assert (flag_value(args, "--cache-data-plane") or "shm") == "shm"


def test_the_model_the_services_load_is_the_one_the_model_service_fetches():
    models_rs = (REPO / "crates" / "gguf" / "src" / "models.rs").read_text()
    block = models_rs.split("pub const DEFAULT_MODEL", 1)[1]
    file_name = re.search(r'file_name:\s*"([^"]+)"', block).group(1)
    fetch_dir = flag_value(command("model"), "--dir")
    assert fetch_dir, "give `pdmesh model fetch` its --dir (the models volume)"
    [(source, target)] = [(s, t) for k, s, t in mounts("model") if t == fetch_dir]
    assert (source, target) == ("models", fetch_dir) and "models" in compose()["volumes"]
    for name in ("tokenizer", "prefill", "decode"):
        model = flag_value(command(name), "--model")
        assert model == f"{fetch_dir}/{file_name}", f"{name} serves {model}"
        assert ("volume", "models", fetch_dir) in mounts(name), f"{name} does not mount the models volume"
    # The services wait for the fetch.
    for name in ("tokenizer", "prefill", "decode"):
        dep = services()[name]["depends_on"]["model"]
        assert dep["condition"] == "service_completed_successfully"


def test_mesh_services_export_traces_to_the_collector_when_asked():
    """Off in the core profile (no collector runs); the endpoint the compose file tells
    users to set for the observability profile is the collector's OTLP/gRPC port."""
    grpc_ports = endpoint_ports(collector_config()["receivers"]["otlp"]["protocols"]["grpc"])
    told = re.findall(r"PDMESH_OTLP_ENDPOINT=(\S+)", COMPOSE_FILE.read_text())
    assert told, "the compose file does not say how to turn trace export on"
    for url in told:
        host, port = hostport(url)
        assert host == "otel-collector" and port in grpc_ports, f"PDMESH_OTLP_ENDPOINT={url}"
    assert "otel-collector" in services() and "observability" in services()["otel-collector"]["profiles"]
    names = set()
    for name in MESH:
        env = environment(name)
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "${PDMESH_OTLP_ENDPOINT:-}", name
        names.add(env.get("OTEL_SERVICE_NAME"))
    assert None not in names and len(names) == len(MESH), f"OTEL_SERVICE_NAME must differ per service: {names}"


# --- observability -------------------------------------------------------------------


def test_prometheus_scrapes_compose_services_on_ports_they_listen_on():
    cfg = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    assert mount_target("prometheus", DEPLOY / "prometheus" / "prometheus.yml") == flag_value(
        command("prometheus"), "--config.file"
    )
    targets = []
    for job in cfg["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                targets.append((job["job_name"], job.get("metrics_path", "/metrics"), t))
    assert targets
    for job, _, t in targets:
        host, port = hostport(t)
        assert host in services(), f"job {job}: {host!r} is not a compose service"
        assert port in listen_ports(host), f"job {job}: {host} listens on {sorted(listen_ports(host))}, not {port}"
    assert any(hostport(t)[0] == "gateway" and path == "/metrics" for _, path, t in targets), (
        "the gateway's /metrics is not scraped"
    )
    rules_target = mount_target("prometheus", DEPLOY / "prometheus" / "rules")
    assert cfg.get("rule_files"), "no rule_files"
    globs = []
    for pattern in cfg["rule_files"]:
        assert str(Path(pattern).parent) == rules_target, f"rule_files {pattern} is not under {rules_target}"
        globs.append(Path(pattern).name)
    # Every rules file is loaded; no promtool unit-test file is (Prometheus would refuse
    # it as a rule file and not start).
    for f in sorted((DEPLOY / "prometheus" / "rules").iterdir()):
        matched = any(fnmatch.fnmatchcase(f.name, g) for g in globs)
        doc = load_yaml(f) if f.suffix in (".yml", ".yaml") else None
        if isinstance(doc, dict) and "groups" in doc:
            assert matched, f"rule_files {cfg['rule_files']} do not load {f.name}"
        else:
            assert not matched, f"rule_files {cfg['rule_files']} load {f.name}, which is not a rules file"


def test_grafana_provisions_the_fixed_datasources_and_the_repositorys_dashboards():
    prov = DEPLOY / "grafana" / "provisioning"
    assert mount_target("grafana", prov) == "/etc/grafana/provisioning"
    sources = []
    for f in sorted((prov / "datasources").glob("*.y*ml")):
        sources += load_yaml(f).get("datasources", [])
    assert sorted(d["uid"] for d in sources) == ["pdmesh-prometheus", "pdmesh-tempo"]
    by_uid = {d["uid"]: d for d in sources}
    assert by_uid["pdmesh-prometheus"]["type"] == "prometheus"
    assert by_uid["pdmesh-tempo"]["type"] == "tempo"
    for d in sources:
        host, port = hostport(d["url"])
        assert host in services() and port in listen_ports(host), f"datasource {d['uid']}: {d['url']}"
    providers = []
    for f in sorted((prov / "dashboards").glob("*.y*ml")):
        providers += load_yaml(f).get("providers", [])
    assert providers, "no dashboards provider"
    dash_target = mount_target("grafana", REPO / "dashboards")
    assert [p["options"]["path"] for p in providers if p.get("type", "file") == "file"] == [dash_target]
    assert any(str(v).endswith(":ro") for v in services()["grafana"]["volumes"] if "dashboards" in str(v))


def test_the_collector_exports_traces_to_a_port_tempo_listens_on():
    cfg = collector_config()
    pipeline = cfg["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"]
    tempo_otlp_grpc = endpoint_ports(tempo_config()["distributor"]["receivers"]["otlp"]["protocols"]["grpc"])
    assert pipeline["exporters"]
    for name in pipeline["exporters"]:
        assert name.split("/", 1)[0] == "otlp", f"{name}: traces go to Tempo over OTLP/gRPC"
        host, port = hostport(cfg["exporters"][name]["endpoint"])
        assert host == "tempo", f"{name} exports to {host}"
        assert port in tempo_otlp_grpc, f"{name} exports to {port}; tempo's OTLP gRPC is on {tempo_otlp_grpc}"
    # The collector listens where the published ports and the services expect it.
    assert {4317, 4318} <= listen_ports("otel-collector")
    assert mount_target("otel-collector", DEPLOY / "otel" / "collector.yaml") in " ".join(command("otel-collector"))
    assert mount_target("tempo", DEPLOY / "tempo" / "tempo.yaml") in " ".join(command("tempo"))
    storage = tempo_config()["storage"]["trace"]
    assert storage["backend"] == "local"
    data = [t for k, s, t in mounts("tempo") if k == "volume"]
    assert data and all(str(storage[k]["path"]).startswith(data[0] + "/") for k in ("wal", "local"))


# --- the image -----------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def toolchain_channel() -> str:
    text = (REPO / "rust-toolchain.toml").read_text()
    return re.search(r'^channel\s*=\s*"([^"]+)"', text, re.M).group(1)


def test_dockerfile_images_are_pinned_and_the_toolchain_matches():
    stages = set()
    images = []
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            image = parts[0]
            if image not in stages:
                images.append(image)
            if len(parts) >= 3 and parts[1].lower() == "as":
                stages.add(parts[2])
    assert len(images) >= 2, "a builder and a runtime stage"
    for image in images:
        ref = image.split("@", 1)[0].rsplit("/", 1)[-1]
        assert ":" in ref and ref.split(":", 1)[1] != "latest", f"FROM {image} is not pinned"
        assert "$" not in image, f"FROM {image} depends on a build argument"
    rust = [i for i in images if i.split(":", 1)[0] in ("rust", "docker.io/library/rust")]
    assert rust, "no rust builder image"
    channel = toolchain_channel()
    assert rust[0].split(":", 1)[1].startswith(channel + "-") or rust[0].split(":", 1)[1] == channel, (
        f"{rust[0]} does not match rust-toolchain.toml's {channel}"
    )
    assert images[0].startswith("debian:"), "the runtime stages are Debian"
    # Both runtime targets sit on the same base; the prebuilt one comes before the Rust
    # stage, so a classic builder that stops at it never needs the rust image.
    bases = {}
    order = []
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            bases[parts[2]] = parts[0]
            order.append(parts[2])
    assert bases["runtime"] == bases["prebuilt"] == "runtime-base", bases
    assert order.index("prebuilt") < order.index("builder") < order.index("runtime"), order
    assert order[-1] == "runtime", "the default target (the last stage) compiles pdmesh"


def test_dockerfile_builds_pdmesh_cli_locked_and_runs_as_a_user():
    inst = dockerfile_instructions()
    builds = [rest for word, rest in inst if word == "RUN" and "cargo build" in rest]
    assert builds, "no cargo build"
    cmd = builds[0].split("cargo build", 1)[1].split("&&", 1)[0].split()
    assert "--locked" in cmd and "--release" in cmd
    assert "pdmesh-cli" in cmd and cmd[cmd.index("pdmesh-cli") - 1] in ("-p", "--package")
    users = [rest for word, rest in inst if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the runtime runs as root"
    entry = [rest for word, rest in inst if word == "ENTRYPOINT"]
    assert entry and "pdmesh" in entry[-1]
    # The compose services build this Dockerfile from the repository root.
    for name in ("model", *MESH):
        build = services()[name]["build"]
        assert (DEPLOY / build["context"]).resolve() == REPO
        assert (REPO / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert "target" in ignore or "/target" in ignore, "target/ would be sent as build context"
