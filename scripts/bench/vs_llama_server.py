#!/usr/bin/env python3
"""pdmesh against llama.cpp's server on the same GGUF and the same machine, in one run.

    python3 scripts/bench/vs_llama_server.py [--build-dir DIR | --llama-server PATH]
        [--rounds 2] [--pd] [--quick] [--out DIR] [--worker-arg ARG ...]
        [--model GGUF] [--chat-template FILE]

It builds llama-server when asked (`--build-dir`: the llama.cpp sources that the PyPI
sdist of llama-cpp-python 0.3.36 vendors, downloaded with pip; cmake from PyPI; built
with the AVX2 / FMA / F16C / AVX-512 / VNNI / BF16 flags this CPU reports and
`GGML_NATIVE=OFF`, because native builds pick AMX, which some kernels refuse with an illegal instruction). Then it
measures the machine's memory read bandwidth, and runs each server in turn, never both
at once, alternating for `--rounds` rounds (pdmesh, llama-server, pdmesh, ...), each
round driving the same `pdmesh bench` workloads:

- decode-1, decode-32, decode-64: that many streams of 128 greedy tokens (`ignore_eos`),
  aggregate output tokens/s;
- prefill-1.3k, prefill-4k: one prompt at a time with `max_tokens: 1`, prompt tokens
  over the time to first token;
- mixed-itl: 16 decode streams while 2k-token prompts arrive (one every 2 s), the decode
  streams' inter-token latency p99;
- sessions: the multi-turn agentic workload (shared system prompt, tools), 8 sessions.

It prints one table (each figure the median over rounds, and pdmesh ÷ llama-server),
writes it as summary.json, and renders both servers' reports of each workload side by
side with `pdmesh bench compare` (plots and an HTML page) under OUT/compare-NAME.
pdmesh runs unified by default (one worker, like llama-server); `--pd` adds a
disaggregated series (prefill and decode workers) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_vs_unified import ROOT, fixed_ports, up  # noqa: E402

PDMESH = os.environ.get("PDMESH_BIN", str(ROOT / "target/release/pdmesh"))
LLAMA_CPP_PYTHON = "0.3.36"

def load(workload: str, concurrency: int, requests: int, input_len: int, output_len: int,
         *more: str) -> list[str]:
    """`pdmesh bench` arguments for one closed-loop workload."""
    return ["--workload", workload, "--concurrency", str(concurrency), "--requests", str(requests),
            "--input-len", str(input_len), "--output-len", str(output_len), *more]


# name: (pdmesh bench arguments, what the figure taken from its report is)
WORKLOADS = {
    **{f"decode-{c}": (load("random", c, max(c, 4), 64, 128), "tok/s") for c in (1, 32, 64)},
    "prefill-1.3k": (load("long", 1, 3, 1300, 1), "prefill tok/s"),
    "prefill-4k": (load("long", 1, 2, 4000, 1), "prefill tok/s"),
    "mixed-itl": (load("random", 16, 16, 64, 256), "ITL p99 ms"),
    "sessions": (load("sessions", 8, 8, 512, 64, "--turns", "4"), "tok/s"),
}
# The arrivals beside mixed-itl's decode streams.
ARRIVALS = ["--workload", "long", "--rate", "0.5", "--requests", "6", "--input-len", "2000",
            "--output-len", "1", "--seed", "7"]
QUICK = {"decode-32", "prefill-1.3k", "decode-1"}


def default_model() -> Path:
    cache = Path(os.environ.get("PDMESH_CACHE_DIR", Path.home() / ".cache/pdmesh"))
    return cache / "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_llama_server(where: Path) -> Path:
    """llama-server from the sources llama-cpp-python vendors; reused when already built."""
    src = where / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    binary = src / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    where.mkdir(parents=True, exist_ok=True)
    sdist = where / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "cmake", "scikit-build-core"], check=True)
    if not sdist.exists():
        subprocess.run([*pip, "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "--no-deps",
                        "--no-binary", "llama-cpp-python", "--no-build-isolation", "-d", str(where)],
                       check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(where, filter="data")
    flags = cpu_flags()
    on = lambda cond: "ON" if cond else "OFF"  # noqa: E731
    # The PyPI cmake installs a `cmake` script beside the interpreter's other scripts.
    cmake = [shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")]
    subprocess.run([*cmake, "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=OFF",
                    f"-DGGML_AVX={on('avx' in flags)}", f"-DGGML_AVX2={on('avx2' in flags)}",
                    f"-DGGML_FMA={on('fma' in flags)}", f"-DGGML_F16C={on('f16c' in flags)}",
                    f"-DGGML_AVX512={on('avx512f' in flags)}",
                    f"-DGGML_AVX512_VNNI={on('avx512_vnni' in flags)}",
                    f"-DGGML_AVX512_VBMI={on('avx512vbmi' in flags)}",
                    f"-DGGML_AVX512_BF16={on('avx512_bf16' in flags)}"], check=True)
    subprocess.run([*cmake, "--build", str(src / "build"), "--target", "llama-server",
                    "-j", str(os.cpu_count() or 2)], check=True)
    return binary


def read_bandwidth() -> float:
    out = subprocess.run(["cargo", "run", "-q", "--release", "-p", "pdmesh-engine", "--example",
                          "read_bandwidth", "--", "2048", str(os.cpu_count() or 2), "--json"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["read_gb_per_s"]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} not ready after {timeout}s")


def bench_cmd(url: str, label: str, out: Path, args: list[str]) -> list[str]:
    return [PDMESH, "bench", "--url", url, "--label", label, "--out", str(out), *args]


def figure(name: str, report: dict) -> float:
    level = report["levels"][0]
    if name.startswith("prefill"):
        return level["prefill_tokens_per_s"]
    if name == "mixed-itl":
        return level["itl"]["p99"] * 1000
    return level["output_tokens_per_s"]


def report_of(wdir: Path, what: str) -> dict:
    """The run's report; a failed request ends the benchmark (its figures would lie)."""
    report = json.loads((wdir / "report.json").read_text())[0]
    if any(level["errors"] for level in report["levels"]):
        sys.exit(f"{what}: requests failed: {report['levels'][0]['errors_by_kind']}")
    return report


def run_workloads(label: str, url: str, out: Path, names: list[str]) -> dict[str, float]:
    got = {}
    for name in names:
        args, _ = WORKLOADS[name]
        wdir = out / name
        cmd = bench_cmd(url, label, wdir, args)
        print("+", " ".join(cmd), flush=True)
        if name == "mixed-itl":
            # The long prompts arrive while the decode streams run.
            side = subprocess.Popen(bench_cmd(url, label, out / "mixed-arrivals", ARRIVALS),
                                    stdout=subprocess.DEVNULL)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            if side.wait(timeout=900) != 0:
                sys.exit(f"{label} {name}: the arriving long prompts failed ({side.returncode})")
            report_of(out / "mixed-arrivals", f"{label} {name} (arriving prompts)")
        else:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        got[name] = figure(name, report_of(wdir, f"{label} {name}"))
        print(f"  {label} {name}: {got[name]:.1f} {WORKLOADS[name][1]}", flush=True)
    return got


def pdmesh_round(label: str, extra: list[str], model: Path, out: Path, names) -> dict[str, float]:
    proc, ports = up([*extra, "--model", str(model), *template_args("--chat-template")])
    try:
        wait_ready(ports["url"].removesuffix("/v1"), proc)
        return run_workloads(label, ports["url"], out, names)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


# `--chat-template FILE`: the Jinja template both servers render chat requests with (for
# a base model such as Gemma 3 270M, whose GGUF has none).
CHAT_TEMPLATE: Path | None = None


def template_args(flag: str) -> list[str]:
    return [flag, str(CHAT_TEMPLATE)] if CHAT_TEMPLATE else []


def llama_round(binary: Path, model: Path, threads: int, out: Path, names) -> dict[str, float]:
    # llama.cpp's server does not say which port 0 gave it.
    port = fixed_ports.outside_ephemeral()
    # 64 slots sharing one 32k-token KV buffer: room for 64 streams or one 4k prompt.
    server = subprocess.Popen(
        [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
         "-np", "64", "-kvu", "-c", "32768", "--jinja", *template_args("--chat-template-file")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", server)
        return run_workloads("llama-server", f"http://127.0.0.1:{port}/v1", out, names)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    peer = ap.add_mutually_exclusive_group(required=True)
    peer.add_argument("--llama-server", type=Path, help="an already built llama-server binary")
    peer.add_argument("--build-dir", type=Path, help="build llama-server here (reused if built)")
    ap.add_argument("--model", type=Path, default=default_model())
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--pd", action="store_true", help="also run pdmesh disaggregated")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(sorted(QUICK))}")
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--out", type=Path, default=Path("bench-vs-llama-server"))
    ap.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                    help="passed to pdmesh's workers (`pdmesh up --worker-arg`), e.g. "
                         "--worker-arg=--step-target-ms=0; repeatable")
    ap.add_argument("--chat-template", type=Path,
                    help="a Jinja chat template both servers use (a base model such as Gemma 3 has none)")
    a = ap.parse_args()
    global CHAT_TEMPLATE
    CHAT_TEMPLATE = a.chat_template
    binary = a.llama_server or build_llama_server(a.build_dir)
    names = [n for n in WORKLOADS if (not a.quick or n in QUICK) and (not a.only or n in a.only.split(","))]
    bw = read_bandwidth()
    weights = a.model.stat().st_size
    print(f"read bandwidth {bw:.2f} GB/s; {weights / 1e6:.1f} MB of weights read per decode step: "
          f"single-stream limit {bw * 1e9 / weights:.1f} tok/s", flush=True)

    # As many sequences per step as llama-server has slots.
    worker = ["--worker-arg=--max-batch=64", *(f"--worker-arg={w}" for w in a.worker_arg)]
    series = {"pdmesh": ["--unified", *worker], **({"pdmesh-pd": worker} if a.pd else {})}
    results: dict[str, dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for label, extra in series.items():
            got = pdmesh_round(label, extra, a.model, a.out / f"round{r}" / label, names)
            for k, v in got.items():
                results.setdefault(label, {}).setdefault(k, []).append(v)
        got = llama_round(binary, a.model, a.threads, a.out / f"round{r}" / "llama-server", names)
        for k, v in got.items():
            results.setdefault("llama-server", {}).setdefault(k, []).append(v)

    med = {s: {k: statistics.median(v) for k, v in w.items()} for s, w in results.items()}
    labels = [*series, "llama-server"]
    print(f"\n{'workload':14} {'figure':14} " + " ".join(f"{s:>13}" for s in labels)
          + " " + " ".join(f"{s + '/llama':>17}" for s in series))
    for n in names:
        ratios = " ".join(f"{med[s][n] / med['llama-server'][n]:17.2f}" for s in series)
        print(f"{n:14} {WORKLOADS[n][1]:14} " + " ".join(f"{med[s][n]:13.1f}" for s in labels)
              + " " + ratios)
    if "decode-1" in names:
        limit = bw * 1e9 / weights
        print(f"\nsingle stream: pdmesh {med['pdmesh']['decode-1'] / limit:.0%} of the bandwidth "
              f"limit ({limit:.0f} tok/s), llama-server {med['llama-server']['decode-1'] / limit:.0%}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps({
        "read_gb_per_s": bw, "weight_bytes": weights, "rounds": a.rounds,
        "cpu": re.sub(r"\s+", " ", next((ln.split(":", 1)[1] for ln in
                      Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "")).strip(),
        "median": med, "all": results}, indent=2))
    last = a.out / f"round{a.rounds - 1}"
    for n in names:
        reports = [str(last / s / n / "report.json") for s in labels]
        subprocess.run([PDMESH, "bench", "compare", *reports, "--out", str(a.out / f"compare-{n}")],
                       check=True, stdout=subprocess.DEVNULL)
    print(f"\nreports: {a.out}/compare-*/index.html, figures: {a.out}/summary.json")


if __name__ == "__main__":
    main()
