#!/usr/bin/env python3
"""Reads the JSON lines of scripts/gpu/check (bench_backend's and the PyTorch peer's) and
prints the figures docs/gpu.md records, as Markdown tables, with the goals of the GPU
work beside them:
  - the fast path at least 1.5x PyTorch eager at batch 16,
  - the invariant path within 2x of the fast one,
  - the engine's load-back copies at least 0.8x one pinned cudaMemcpy of the same bytes.

    python3 scripts/gpu/summary.py bench.jsonl

Exit status 0 whatever the figures: these are goals to report, not checks.
"""

import json
import sys


def main():
    runs, loads, mm = {}, [], {}
    for line in open(sys.argv[1]):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "load_back" in r:
            loads.append(r)
            continue
        if "matmul" in r:
            m = r["matmul"]
            mm.setdefault((m["rows"], m["cols"], m["tokens"]), {})[m["kernel"]] = m["gflop_s"]
            continue
        kind = r["device"]
        if kind == "cuda":
            kind = "gpu" if r.get("invariant", True) else "gpu-fast"
        runs[(r["model"], r["batch"], kind)] = r
    kinds = ["cpu", "gpu", "gpu-fast", "torch"]
    for phase in ["prefill", "decode"]:
        notes = []
        print(f"\n{phase} tokens/s\n")
        print("| model | batch | " + " | ".join(kinds) + " | fast / torch | fast / invariant |")
        print("|---|---:|" + "---:|" * (len(kinds) + 2))
        for model, batch in sorted({(m, b) for m, b, _ in runs}):
            val = {k: runs.get((model, batch, k), {}).get(f"{phase}_tok_s") for k in kinds}
            ratio = lambda a, b: f"{val[a] / val[b]:.2f}x" if val[a] and val[b] else "-"
            cells = [f"{val[k]:.0f}" if val[k] else "-" for k in kinds]
            print(f"| {model} | {batch} | " + " | ".join(cells)
                  + f" | {ratio('gpu-fast', 'torch')} | {ratio('gpu-fast', 'gpu')} |")
            if batch == 16 and val["gpu-fast"] and val["torch"]:
                goal = val["gpu-fast"] / val["torch"] >= 1.5
                notes.append(f"{model}: fast at least 1.5x PyTorch at batch 16: {'met' if goal else 'NOT met'}")
            if val["gpu-fast"] and val["gpu"]:
                goal = val["gpu-fast"] / val["gpu"] <= 2.0
                if not goal:
                    notes.append(f"{model}: invariant within 2x of fast: NOT met at batch {batch}")
        print("".join(f"\n- {n}" for n in notes))
    if mm:
        print("\nmatrix products alone, GFLOP/s (rows x cols weights, tokens)\n")
        print("| rows x cols | tokens | matmul_rows | matmul_tiles | cuBLAS | tiles / rows | cuBLAS / tiles |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for (rows, cols, tokens), k in sorted(mm.items()):
            r_, t_, c_ = k.get("Rows"), k.get("Tiles"), k.get("Cublas")
            ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
            print(f"| {rows} x {cols} | {tokens} | {r_ or 0:.0f} | {t_ or 0:.0f} | {c_ or 0:.0f} "
                  f"| {ratio(t_, r_)} | {ratio(c_, t_)} |")
    for r in loads:
        lb = r["load_back"]
        print(f"\nload-back of {r['pages']} pages ({lb['bytes'] / 1e6:.0f} MB): per page and layer "
              f"{lb['per_layer_gb_s']:.1f} GB/s ({r['per_layer_vs_bulk']:.2f}x), per page "
              f"{lb['per_page_gb_s']:.1f} GB/s ({r['per_page_vs_bulk']:.2f}x), one pinned copy "
              f"{lb['bulk_pinned_gb_s']:.1f} GB/s, pageable {lb['bulk_pageable_gb_s']:.1f} GB/s; "
              f"goal 0.8x: {'met' if r['per_layer_vs_bulk'] >= 0.8 else 'NOT met'}")


if __name__ == "__main__":
    main()
