#!/usr/bin/env python3
"""The PyTorch peer for `bench_backend`: the same GGUF (SmolLM2 by default), dequantized by
transformers' GGUF loader, run as an f32 model on the GPU with its KV cache, at the same
batch sizes, prompt length and token count. Prints JSON lines with bench_backend's keys
(device "torch"), so the two can be set side by side.

    python3 scripts/bench/torch_peer.py --gguf PATH [--batches 1,16,64] [--prompt-len 128]
        [--tokens 64] [--dtype float32|bfloat16]

Needs torch, transformers and the `gguf` package.
"""

import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM


def prompts(batch, prompt_len, vocab, rnd):
    # The formula bench_backend uses, so both measure the same token ids.
    return [
        [((i * 7919 + j * 104_729 + rnd * 15_485_863) + 3) % (2**32) % vocab for j in range(prompt_len)]
        for i in range(batch)
    ]


@torch.inference_mode()
def run(model, batch, prompt_len, tokens, rnd, vocab):
    ids = torch.tensor(prompts(batch, prompt_len, vocab, rnd), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    past = out.past_key_values
    t1 = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    decode = time.perf_counter() - t1
    return batch * prompt_len / prefill, batch * (tokens - 1) / decode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    path = os.path.abspath(a.gguf)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, a.dtype)
    ).to("cuda").eval()
    vocab = model.config.vocab_size
    run(model, 1, 16, 4, 0, vocab)  # warm-up
    for rnd, b in enumerate(int(x) for x in a.batches.split(",")):
        prefill, decode = run(model, b, a.prompt_len, a.tokens, rnd + 1, vocab)
        print(json.dumps({
            "model": os.path.basename(path),
            "device": "torch",
            "dtype": a.dtype,
            "batch": b,
            "prompt_len": a.prompt_len,
            "tokens": a.tokens,
            "prefill_tok_s": round(prefill, 1),
            "decode_tok_s": round(decode, 1),
        }), flush=True)


if __name__ == "__main__":
    main()
