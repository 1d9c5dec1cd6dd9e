#!/usr/bin/env python3
"""The PyTorch peer for `bench_backend`: the same weights run by transformers, eager, with
its KV cache, at the same batch sizes, prompt length and token count. Prints JSON lines
with bench_backend's keys (device "torch"), so the two can be set side by side.

    python3 scripts/bench/torch_peer.py (--gguf PATH | --hf-dir DIR) [--label NAME]
        [--batches 1,16,64] [--prompt-len 128] [--tokens 64]
        [--dtype float32|bfloat16] [--device cuda|cpu]

`--gguf`: a GGUF file (SmolLM2 by default in bench_backend), dequantized by transformers'
GGUF loader (needs the `gguf` package). `--hf-dir`: a Hugging Face checkpoint directory,
such as `pdmesh model synth deepseek-v32-tiny --out DIR` writes (transformers'
DeepseekV32ForCausalLM). Weights in fp8 with 128 x 128 `weight_scale_inv` blocks are
dequantized here first, as pdmesh dequantizes them at load. Needs torch and transformers.
"""

import argparse
import json
import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM


def prompts(batch, prompt_len, vocab, rnd):
    # The formula bench_backend uses, so both measure the same token ids.
    return [
        [((i * 7919 + j * 104_729 + rnd * 15_485_863) + 3) % (2**32) % vocab for j in range(prompt_len)]
        for i in range(batch)
    ]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def run(model, batch, prompt_len, tokens, rnd, vocab, device):
    ids = torch.tensor(prompts(batch, prompt_len, vocab, rnd), device=device)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    prefill = time.perf_counter() - t0
    past = out.past_key_values
    t1 = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    decode = time.perf_counter() - t1
    return batch * prompt_len / prefill, batch * (tokens - 1) / decode


def dequantized_copy(src, dst):
    """Copy the checkpoint `src` to `dst` with every fp8 weight and its `weight_scale_inv`
    (one scale per 128 x 128 block) replaced by the bf16 product, and the quantization
    config dropped: the weights pdmesh computes with, in a form transformers loads."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    block = config.pop("quantization_config", {}).get("weight_block_size", [128, 128])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            continue
        tensors = load_file(os.path.join(src, name))
        out = {}
        for key, t in tensors.items():
            if key.endswith(".weight_scale_inv"):
                continue
            scale = tensors.get(key + "_scale_inv") if key.endswith(".weight") else None
            if scale is not None:
                rows, cols = t.shape
                s = scale.float().repeat_interleave(block[0], 0)[:rows]
                s = s.repeat_interleave(block[1], 1)[:, :cols]
                t = (t.float() * s).to(torch.bfloat16)
            out[key] = t.contiguous()
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})


def load(a, dtype, scratch):
    if a.gguf:
        path = os.path.abspath(a.gguf)
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
        ), os.path.basename(path)
    dequantized_copy(a.hf_dir, scratch)
    model = AutoModelForCausalLM.from_pretrained(scratch, dtype=dtype)
    return model, os.path.basename(os.path.normpath(a.hf_dir))


def main():
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf")
    src.add_argument("--hf-dir")
    ap.add_argument("--label", help="the model name printed (bench_backend's, to pair them)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model, name = load(a, getattr(torch, a.dtype), scratch)
    model = model.to(a.device).eval()
    vocab = model.config.vocab_size
    run(model, 1, 16, 4, 0, vocab, a.device)  # warm-up
    for rnd, b in enumerate(int(x) for x in a.batches.split(",")):
        prefill, decode = run(model, b, a.prompt_len, a.tokens, rnd + 1, vocab, a.device)
        print(json.dumps({
            "model": a.label or name,
            "device": "torch" if a.device == "cuda" else "torch-cpu",
            "dtype": a.dtype,
            "batch": b,
            "prompt_len": a.prompt_len,
            "tokens": a.tokens,
            "prefill_tok_s": round(prefill, 1),
            "decode_tok_s": round(decode, 1),
        }), flush=True)


if __name__ == "__main__":
    main()
