#!/usr/bin/env python3
"""Build MLX models with mlx-lm's own converter and score them with mlx-lm, as the oracle
for ferrolm's NLL on the same directories (scripts/mlx-corpus.sh drives it).

  mlx_corpus.py convert SRC_DIR OUT_DIR --bits B --group G [--predicate mixed_3_6]
      mlx_lm.convert of a Hugging Face safetensors directory (here: `ferrolm convert
      --quantize bf16` of SmolLM2) with the given bits and group, or with one of mlx-lm's
      mixed-precision recipes (mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6). Exits 3 when
      mlx-lm refuses the combination (e.g. a group that does not divide a dimension).
  mlx_corpus.py score DIR TEXT_FILE OUT_JSON
      Teacher-forced NLL of the text (tokenized by the directory's tokenizer, as mlx-lm
      loads it) per position, argmax and top-2 margin, in float32 on the CPU.
"""
import argparse
import json
import math
import sys


def convert(a):
    from mlx_lm import convert as mlx_convert

    kw = dict(hf_path=a.src, mlx_path=a.out, quantize=True, q_group_size=a.group, q_bits=a.bits)
    if a.predicate:
        kw["quant_predicate"] = a.predicate
    try:
        mlx_convert(**kw)
    except (ValueError, RuntimeError) as e:
        print(f"mlx-lm refuses: {e}", file=sys.stderr)
        sys.exit(3)


def score(a):
    import mlx.core as mx
    from mlx_lm import load

    mx.set_default_device(mx.cpu)
    model, tok = load(a.dir)
    # float32 like ferrolm's CPU path (the bf16 scales widen exactly): MLX's bf16 CPU math
    # would add its own rounding to the comparison.
    model.set_dtype(mx.float32)
    ids = tok.encode(open(a.text).read(), add_special_tokens=False)
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top2 = mx.topk(logits, 2, axis=-1)
    mx.eval(logp, top2)
    nll, argmax, margin = [], [], []
    lp = logp.tolist()
    t2 = mx.sort(top2, axis=-1).tolist()
    am = mx.argmax(logits, axis=-1).tolist()
    for i in range(len(ids) - 1):
        nll.append(-lp[i][ids[i + 1]])
        argmax.append(am[i])
        margin.append(t2[i][1] - t2[i][0])
    json.dump({"ids": ids, "nll": nll, "argmax": argmax, "margin": margin}, open(a.out, "w"))
    print(f"mlx-lm ppl {math.exp(sum(nll) / len(nll)):.4f} over {len(nll)} positions", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--bits", type=int, required=True)
    c.add_argument("--group", type=int, required=True)
    c.add_argument("--predicate")
    s = sub.add_parser("score")
    s.add_argument("dir")
    s.add_argument("text")
    s.add_argument("out")
    a = ap.parse_args()
    convert(a) if a.cmd == "convert" else score(a)


if __name__ == "__main__":
    main()
