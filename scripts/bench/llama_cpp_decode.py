#!/usr/bin/env python3
"""The llama.cpp peer for crates/engine/examples/bench_decode.rs: single-stream greedy
decode tokens/s of llama.cpp (llama-cpp-python, 2 threads) on the same GGUF, prefill
excluded. A developer tool: `pip install llama-cpp-python==0.3.36`, then
`python3 scripts/bench/llama_cpp_decode.py [--model PATH] [--tokens 128]`.
"""
import argparse
import os
import time

from llama_cpp import Llama


def default_model():
    cache = os.environ.get("PDMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdmesh")
    return os.environ.get("PDMESH_MODEL") or os.path.join(cache, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    llm = Llama(model_path=a.model, n_ctx=1024, n_threads=a.threads, n_batch=512, verbose=False)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 1, 4093, 198]
    best = 0.0
    for _ in range(3):
        llm.reset()
        llm.eval(prompt)
        tok = llm.sample(temp=0.0)
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            llm.eval([tok])
            tok = llm.sample(temp=0.0)
        dt = time.perf_counter() - t0
        best = max(best, a.tokens / dt)
    print(f"llama.cpp single-stream decode: {best:.1f} tokens/s ({a.threads} threads, best of 3)")


if __name__ == "__main__":
    main()
