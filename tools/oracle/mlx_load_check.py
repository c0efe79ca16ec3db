#!/usr/bin/env python3
"""Check that mlx-lm loads a directory written by `ferrolm convert` and computes the same
next-token argmax as an expectation file.

The expectation is JSON: {"tokens": [id, ...], "argmax": [id per position]}. The model is
loaded with mlx_lm.utils.load_model (weights + config.json only, so placeholder tokenizer
files are fine) on the CPU, run once over the tokens, and the per-position argmax compared.
Exit status 1 when more than --max-mismatch of the positions differ (quantized weights run
in another precision can flip near-ties, hence a tolerance rather than exact equality).

  # compare against an expectation
  mlx_load_check.py OUT_DIR --expect expected.json
  # record what mlx-lm computes (e.g. for a later regression check)
  mlx_load_check.py OUT_DIR --tokens 1,2,3 --write-expect got.json
  # independent expectation from a GGUF: transformers dequantizes it to f32 and runs it
  mlx_load_check.py --gguf-reference model.gguf --tokens 1,2,3 --write-expect expected.json
  # tokens from text, through the directory's tokenizer (needs real tokenizer files)
  mlx_load_check.py OUT_DIR --prompt "The capital of France is" --write-expect got.json
"""

import argparse
import json
import sys
from pathlib import Path


def mlx_argmax(model_dir: Path, tokens):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    model, config = load_model(model_dir)
    # Compute in float32 like ferrolm's CPU path (bf16/f16 scales widen exactly); MLX's CPU
    # bf16 math is both slow and noisier, which would hide a real weight mismatch.
    model.set_dtype(mx.float32)
    quantized = sum(1 for _, m in model.named_modules() if "Quantized" in type(m).__name__)
    print(f"mlx-lm loaded {model_dir}: model_type={config.get('model_type')}, "
          f"{quantized} quantized modules", file=sys.stderr)
    logits = model(mx.array([tokens]))
    mx.eval(logits)
    print(f"logits {tuple(logits.shape)} {logits.dtype}", file=sys.stderr)
    return mx.argmax(logits[0], axis=-1).tolist()


def gguf_argmax(gguf: Path, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits
    return logits[0].argmax(-1).tolist()


def prompt_tokens(model_dir: Path, prompt: str):
    from mlx_lm import load

    _, tok = load(str(model_dir))
    return tok.encode(prompt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", type=Path, help="directory written by ferrolm convert")
    ap.add_argument("--expect", type=Path, help="JSON {tokens, argmax} to compare against")
    ap.add_argument("--tokens", help="comma-separated token ids (default: the expectation's)")
    ap.add_argument("--prompt", help="text to tokenize with the directory's tokenizer")
    ap.add_argument("--write-expect", type=Path, help="write {tokens, argmax} computed here")
    ap.add_argument("--gguf-reference", type=Path, help="compute the argmax from this GGUF with transformers")
    ap.add_argument("--max-mismatch", type=float, default=0.05, help="allowed fraction of differing positions")
    a = ap.parse_args()

    expected = json.loads(a.expect.read_text()) if a.expect else None
    if a.tokens:
        tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    elif a.prompt:
        tokens = prompt_tokens(a.model_dir, a.prompt)
    elif expected:
        tokens = expected["tokens"]
    else:
        ap.error("give --tokens, --prompt or --expect")

    if a.gguf_reference:
        got = gguf_argmax(a.gguf_reference, tokens)
    elif a.model_dir:
        got = mlx_argmax(a.model_dir, tokens)
    else:
        ap.error("give a model directory or --gguf-reference")
    print(f"tokens {tokens}\nargmax {got}")

    if a.write_expect:
        a.write_expect.write_text(json.dumps({"tokens": tokens, "argmax": got}))
    if expected is None:
        return 0
    if expected["tokens"] != tokens:
        print("the expectation was computed over other tokens", file=sys.stderr)
        return 2
    want = expected["argmax"]
    if len(want) != len(got):
        print(f"expected {len(want)} positions, got {len(got)}", file=sys.stderr)
        return 1
    bad = [i for i, (x, y) in enumerate(zip(want, got)) if x != y]
    frac = len(bad) / max(len(want), 1)
    print(f"argmax mismatch: {len(bad)}/{len(want)} positions ({frac:.1%}) at {bad[:20]}")
    if frac > a.max_mismatch:
        print(f"FAIL: more than {a.max_mismatch:.0%} of positions differ", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
