#!/usr/bin/env python3
"""A Q4_0 GGUF of a real Llama shape with SYNTHETIC (random) weights, so llama.cpp and
ferrolm can be benchmarked side by side on the same file at sizes we cannot download.

    PYTHONPATH=<llama.cpp>/gguf-py python3 tools/peers/synth_gguf.py \
        --tokenizer-from SmolLM2-135M-Instruct.Q4_1.gguf --shape llama-3.2-1b --output 1b.gguf

Needs numpy and llama.cpp's gguf-py (the `gguf` package; on the GPU machine it is carried
from the llama-cpp-python sdist, docs/peers.md). The tokenizer is SmolLM2's (BPE, 49 152
tokens) padded with unused user-defined tokens up to the shape's vocabulary, so the head
and embedding have their real size. Weights: random 4-bit codes with one f16 scale per 32
values (std ≈ 0.02); norms are ones. Numbers measured on these files are synthetic-weight
numbers and must say so.
"""
import argparse

import numpy as np
import gguf

SHAPES = {
    # hidden, layers, heads, kv heads, ffn, vocab, rope theta
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256, 500000.0),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256, 500000.0),
    "llama-3.1-70b": (8192, 80, 64, 8, 28672, 128256, 500000.0),
}
QK = 32  # values per Q4_0 block: f16 scale + 16 bytes of 4-bit codes


def q4_0(rng, rows, cols, scale=0.0043):
    blocks = rng.integers(0, 256, size=(rows, cols // QK, 18), dtype=np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, cols // QK * 18)


def field(reader, key):
    f = reader.fields[key]
    if len(f.types) > 1 and f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]) for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-from", required=True, help="a GGUF with a BPE tokenizer (SmolLM2)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    d, n_layers, heads, n_kv, ffn, vocab, theta = SHAPES[a.shape]
    hd, kvd = d // heads, d // heads * n_kv

    src = gguf.GGUFReader(a.tokenizer_from)
    tokens = field(src, "tokenizer.ggml.tokens")
    types = field(src, "tokenizer.ggml.token_type")
    merges = field(src, "tokenizer.ggml.merges")
    if len(tokens) > vocab:
        raise SystemExit(f"tokenizer has {len(tokens)} tokens, more than the shape's {vocab}")
    pad = vocab - len(tokens)
    tokens += [f"<synthetic_pad_{i}>".encode() for i in range(pad)]
    types += [gguf.TokenType.USER_DEFINED] * pad

    w = gguf.GGUFWriter(a.output, "llama")
    w.add_name(f"{a.shape} synthetic Q4_0")
    w.add_context_length(131072)
    w.add_embedding_length(d)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(field(src, "tokenizer.ggml.pre") if "tokenizer.ggml.pre" in src.fields else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(field(src, "tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field(src, "tokenizer.ggml.eos_token_id"))

    rng = np.random.default_rng(a.seed)
    q4 = gguf.GGMLQuantizationType.Q4_0
    ones = np.ones(d, dtype=np.float32)
    w.add_tensor("token_embd.weight", q4_0(rng, vocab, d), raw_dtype=q4)
    w.add_tensor("output_norm.weight", ones)
    for i in range(n_layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "attn_q.weight", q4_0(rng, d, d), raw_dtype=q4)
        w.add_tensor(b + "attn_k.weight", q4_0(rng, kvd, d), raw_dtype=q4)
        w.add_tensor(b + "attn_v.weight", q4_0(rng, kvd, d), raw_dtype=q4)
        w.add_tensor(b + "attn_output.weight", q4_0(rng, d, d), raw_dtype=q4)
        w.add_tensor(b + "ffn_norm.weight", ones)
        w.add_tensor(b + "ffn_gate.weight", q4_0(rng, ffn, d), raw_dtype=q4)
        w.add_tensor(b + "ffn_up.weight", q4_0(rng, ffn, d), raw_dtype=q4)
        w.add_tensor(b + "ffn_down.weight", q4_0(rng, d, ffn), raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {a.output}: {a.shape}, synthetic Q4_0, vocab {vocab} ({pad} padding tokens)")


if __name__ == "__main__":
    main()
