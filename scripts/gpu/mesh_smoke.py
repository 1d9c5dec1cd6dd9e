#!/usr/bin/env python3
"""The whole mesh on a GPU: `pdmesh up` with its workers on the CPU, then again with
`--worker-arg=--device=cuda`, each asked the same questions through the gateway's OpenAI
API at temperature 0. The GPU mesh must answer, and answer as the CPU mesh does (greedy
output is the same on both backends). Standard library only: it runs on the GPU machine.

    python3 scripts/gpu/mesh_smoke.py --pdmesh BIN --model MODEL [--unified]
        [--logs DIR] [--timeout 240]

Exit status: 0 when both meshes answered every question alike.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def ask(base, model, question):
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 48,
        "temperature": 0,
    }).encode()
    req = urllib.request.Request(f"{base}/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        v = json.load(r)
    return v["choices"][0]["message"]["content"], v["usage"]


def mesh(a, label, extra, logs):
    """Start one mesh, ask it every question, stop it. Returns the answers."""
    tmp = tempfile.mkdtemp(prefix=f"pdmesh-{label}-")
    ports = os.path.join(tmp, "ports.json")
    cmd = [a.pdmesh, "up", "--model", a.model, "--port", "0", "--ports-json", ports,
           "--incident-dir", os.path.join(tmp, "incidents"), *extra]
    if a.unified:
        cmd.append("--unified")
    log = open(os.path.join(logs, f"mesh-{label}.log"), "w")
    print(f"==> {label}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not os.path.exists(ports):
            if proc.poll() is not None:
                raise SystemExit(f"{label}: pdmesh up exited with {proc.returncode} before it was up")
            if time.monotonic() - t0 > a.timeout:
                raise SystemExit(f"{label}: not up within {a.timeout} s")
            time.sleep(0.2)
        up = time.monotonic() - t0
        info = json.load(open(ports))
        answers = []
        for q in QUESTIONS:
            t = time.monotonic()
            text, usage = ask(info["url"], info["model"], q)
            answers.append(text)
            print(f"    {label} ({time.monotonic() - t:.2f} s, {usage['completion_tokens']} tokens): "
                  f"{text!r}", flush=True)
        print(f"    {label}: up in {up:.1f} s", flush=True)
        return answers
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
            print(f"    {label}: stopped, exit {code}", flush=True)
        log.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdmesh", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--unified", action="store_true")
    ap.add_argument("--logs", default=".")
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args()
    os.makedirs(a.logs, exist_ok=True)
    cpu = mesh(a, "cpu", [], a.logs)
    gpu = mesh(a, "cuda", ["--worker-arg=--device=cuda"], a.logs)
    bad = [(q, c, g) for q, c, g in zip(QUESTIONS, cpu, gpu) if c != g or not g.strip()]
    for q, c, g in bad:
        print(f"DIFFERENT for {q!r}:\n  cpu:  {c!r}\n  cuda: {g!r}")
    if bad:
        sys.exit(1)
    print(f"the GPU mesh answered all {len(QUESTIONS)} questions as the CPU mesh did")


if __name__ == "__main__":
    main()
