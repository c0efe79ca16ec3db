#!/usr/bin/env python3
"""Independent numpy-only Llama forward pass from a GGUF file; cross-checks the HF golden.

Purpose
-------
``hf_golden.py`` trusts Transformers' GGUF loader (dequantization, un-permuting
the q/k rows, tokenizer, config mapping). This script is a second, independent
implementation that shares none of that code path: it reads tensors with the
``gguf`` package's ``GGUFReader``, dequantizes them with ``gguf.quants.dequantize``
and runs the Llama forward pass in float64 numpy directly on the GGUF layout.

GGUF stores llama q/k weights with rows permuted for llama.cpp's *interleaved*
RoPE (rotates adjacent pairs ``(x[2i], x[2i+1])``), while HF un-permutes them and
uses ``rotate_half`` (pairs ``(x[i], x[i+d/2])``). Here we keep the GGUF rows
and apply interleaved RoPE, so agreement with Transformers also confirms the
loader's un-permutation is right.

It takes the token ids of one text from the golden JSON (default: the prose
text), computes per-position NLL and argmax, and compares them with the golden:
it passes if mean |dNLL| <= 1e-3 (exit code 0), else exits 1.
With ``--greedy`` it also re-decodes every greedy prompt of the golden (full
prefix recompute, float64) and reports where its argmax path departs from
Transformers' (f32) one, with the golden's top-2 margin at that step.

How to run
----------
    python3 tools/oracle/numpy_llama.py \
        [--model /root/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf] \
        [--golden crates/engine/tests/goldens/smollm2_hf.json] [--text prose] [--greedy]

Needs only numpy and gguf. Takes ~15 s (``--greedy``: ~4 min); single-threaded BLAS is
fine (set OMP_NUM_THREADS=1 / OPENBLAS_NUM_THREADS=1 to keep CPU use modest).
"""

import argparse
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

DEFAULT_MODEL = "/root/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GOLDEN = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..", "..", "crates", "engine", "tests", "goldens", "smollm2_hf.json",
)


class Gguf:
    def __init__(self, path):
        self.r = GGUFReader(path)
        self.t = {t.name: t for t in self.r.tensors}
        self.cache = None  # name -> float64 array, when cache_all() was called

    def cache_all(self):
        self.cache = {n: self.w(n) for n in self.t}

    def kv(self, key):
        return self.r.fields[key].contents()

    def w(self, name):
        """Dequantized tensor as float64, numpy shape = reversed GGUF ne (rows = ne[1])."""
        if self.cache is not None and name in self.cache:
            return self.cache[name]
        t = self.t[name]
        a = dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        return np.asarray(a, dtype=np.float64).reshape(shape)


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_interleaved(x, pos, base):
    """x: (T, H, D). Rotate adjacent pairs (2i, 2i+1) by pos * base^(-2i/D) (llama.cpp mode 0)."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (D/2,)
    ang = pos[:, None] * inv[None, :]  # (T, D/2)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def forward(g, ids):
    n_layer = int(g.kv("llama.block_count"))
    n_head = int(g.kv("llama.attention.head_count"))
    n_kv = int(g.kv("llama.attention.head_count_kv"))
    eps = float(g.kv("llama.attention.layer_norm_rms_epsilon"))
    base = float(g.kv("llama.rope.freq_base"))
    emb = g.w("token_embd.weight")  # (vocab, dim)
    dim = emb.shape[1]
    hd = dim // n_head
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    mask = np.triu(np.full((T, T), -np.inf), k=1)

    x = emb[np.asarray(ids)]
    for L in range(n_layer):
        p = f"blk.{L}."
        h = rms_norm(x, g.w(p + "attn_norm.weight"), eps)
        q = (h @ g.w(p + "attn_q.weight").T).reshape(T, n_head, hd)
        k = (h @ g.w(p + "attn_k.weight").T).reshape(T, n_kv, hd)
        v = (h @ g.w(p + "attn_v.weight").T).reshape(T, n_kv, hd)
        q, k = rope_interleaved(q, pos, base), rope_interleaved(k, pos, base)
        rep = n_head // n_kv
        k = np.repeat(k, rep, axis=1)  # head h uses kv head h // rep
        v = np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = s - s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=-1, keepdims=True)
        a = np.einsum("hts,shd->thd", pr, v).reshape(T, dim)
        x = x + a @ g.w(p + "attn_output.weight").T
        h = rms_norm(x, g.w(p + "ffn_norm.weight"), eps)
        gt = h @ g.w(p + "ffn_gate.weight").T
        up = h @ g.w(p + "ffn_up.weight").T
        x = x + ((gt / (1.0 + np.exp(-gt))) * up) @ g.w(p + "ffn_down.weight").T
    x = rms_norm(x, g.w("output_norm.weight"), eps)
    out_name = "output.weight" if "output.weight" in g.t else "token_embd.weight"  # tied
    return x @ g.w(out_name).T, out_name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--golden", default=DEFAULT_GOLDEN)
    ap.add_argument("--text", default="prose")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--greedy", action="store_true", help="also re-decode the greedy prompts")
    args = ap.parse_args()

    golden = json.load(open(args.golden))
    entry = next(t for t in golden["texts"] if t["name"] == args.text)
    ids = entry["ids"]

    g = Gguf(args.model)
    logits, out_name = forward(g, ids)
    lg = logits[:-1]
    m = lg.max(axis=-1, keepdims=True)
    logp = lg - m - np.log(np.exp(lg - m).sum(axis=-1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    argmax = lg.argmax(axis=-1)
    srt = np.sort(lg, axis=-1)
    margin = srt[:, -1] - srt[:, -2]

    g_nll = np.asarray(entry["nll"])
    g_arg = np.asarray(entry["argmax"])
    g_margin = np.asarray(entry["margin"])
    d = np.abs(nll - g_nll)
    mism = np.nonzero(argmax != g_arg)[0]
    print(f"text={args.text} tokens={len(ids)} lm_head={out_name}")
    print(f"numpy ppl={np.exp(nll.mean()):.6f}  hf ppl={np.exp(g_nll.mean()):.6f}")
    print(f"|dNLL| mean={d.mean():.3e} max={d.max():.3e}")
    print(f"|dMargin| max={np.abs(margin - g_margin).max():.3e}")
    print(f"argmax mismatches={len(mism)} at {mism.tolist()} (hf margins there: {g_margin[mism].tolist()})")
    ok = d.mean() <= args.tol
    if args.greedy:
        g.cache_all()
        for gr in golden["greedy"]:
            seq = list(gr["prompt_ids"])
            for step, want in enumerate(gr["continuation_ids"]):
                nxt = int(forward(g, seq)[0][-1].argmax())
                if nxt != want:
                    print(f"greedy {gr['name']}: diverges at step {step} (numpy {nxt}, hf {want}, "
                          f"hf margin {gr['margins'][step]})")
                    break
                seq.append(nxt)
            else:
                print(f"greedy {gr['name']}: all {len(gr['continuation_ids'])} tokens match")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
