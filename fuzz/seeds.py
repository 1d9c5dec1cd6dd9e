#!/usr/bin/env python3
"""Writes the committed seed corpus of each fuzz target (fuzz/corpus/<target>/): small,
well-formed inputs the fuzzer mutates from. Deterministic; run it again after changing a
target's input format:  python3 fuzz/seeds.py"""
import hashlib
import json
import struct
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"


def put(target: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)


# tool_parsers: [format selector, chunk step, text...]; formats 0 DSML, 1 DeepSeek V3,
# 2 DeepSeek V3.1, 3 Hermes; bit 2 of the selector ends the output as cut short.
D = "｜DSML｜"
args = {"city": "Paris", "days": 2}
a = json.dumps(args)
outputs = {
    0: f'Let me check.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n'
       f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
       f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n</{D}function_calls>',
    1: f"Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{a}\n```"
       "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
    2: f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{{\"q\": \"rust\"}}<｜tool▁call▁end｜>"
       f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{a}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    3: f'Checking 🦀 <tool_call>\n{{"name": "get_weather", "arguments": {a}}}\n</tool_call><|im_end|>',
}
for sel, text in outputs.items():
    for step in (0, 3):
        put("tool_parsers", bytes([sel, step]) + text.encode())
    put("tool_parsers", bytes([sel | 4, 1]) + text.encode()[: len(text.encode()) * 2 // 3])
put("tool_parsers", bytes([3, 2]) + b"plain text with <tool_call> written by a user and no end")

# schema_grammar: JSON schemas, from a tool's parameters to nested $ref/allOf chains.
schemas = [
    {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
     "required": ["city"], "additionalProperties": False},
    {"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
     "$ref": "#/$defs/node"},
]
nested = {"$defs": {"l0": {"type": "string"}}}
for i in range(1, 6):
    nested["$defs"][f"l{i}"] = {"allOf": [{"$ref": f"#/$defs/l{i-1}"}, {"$ref": f"#/$defs/l{i-1}"}]}
nested["$ref"] = "#/$defs/l5"
schemas.append(nested)
schemas.append({"type": "object", "oneOf": [{"properties": {"a": {"const": 1}}}, {"properties": {"b": {"enum": ["x", "y"]}}}]})
for s in schemas:
    put("schema_grammar", json.dumps(s).encode())


# gguf_reader: small GGUF v3 images (as pdmesh's writer makes them).
def gstr(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf(meta: list[tuple[str, int, bytes]], tensors: list[tuple[str, list[int], int, bytes]]) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    for k, t, v in meta:
        out += gstr(k) + struct.pack("<I", t) + v
    off = 0
    for name, dims, ty, data in tensors:
        out += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, off)
        off += -(-len(data) // 32) * 32
    out += b"\0" * (-len(out) % 32)
    for *_, data in tensors:
        out += data + b"\0" * (-len(data) % 32)
    return out


tokens = struct.pack("<IQ", 8, 2) + gstr("a") + gstr("é")
meta = [("general.architecture", 8, gstr("llama")), ("llama.block_count", 4, struct.pack("<I", 2)),
        ("tokenizer.ggml.tokens", 9, tokens)]
f32 = struct.pack("<4f", 1.0, -2.0, 3.5, 0.25)
put("gguf_reader", gguf(meta, [("norm.weight", [4], 0, f32)]))
put("gguf_reader", gguf(meta[:1], [("a", [4], 0, f32), ("b", [2, 2], 0, f32)]))
put("gguf_reader", gguf([("general.alignment", 4, struct.pack("<I", 64))], []))

# transport_frames: [mode, ...]; mode bit 0: the real hello first; bit 1: the rest is a
# script of 4-byte batch steps [room, pages, faults, trailer] (see the target).
put("transport_frames", bytes([3, 1, 2, 0, 4, 2, 1, 0, 0]))
put("transport_frames", bytes([3, 0, 3, 0, 8, 1, 2, 1, 0, 1, 1, 4, 0]))
put("transport_frames", bytes([3, 2, 3, 0x18, 0]))
put("transport_frames", bytes([1]) + struct.pack("<QIII", 1, 0, 0, 4) + b"trlr")
put("transport_frames", bytes([0]) + b"PDKV\x04\x00\x05hello")
