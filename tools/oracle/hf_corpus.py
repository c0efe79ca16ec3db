#!/usr/bin/env python3
"""Write models with Transformers 5's own save_pretrained and score them with Transformers,
as the oracle for ferrolm's NLL on the same directories (scripts/hf-corpus.sh drives it).

  hf_corpus.py build ROOT TEXT_FILE [CASE...]
      For each case (default: all of CASES below) writes ROOT/CASE/ with
      `model.save_pretrained` (safetensors, the default) and `tokenizer.save_pretrained`,
      loads that directory back with `AutoModelForCausalLM.from_pretrained(dir,
      dtype=torch.float32)` and writes ROOT/CASE.hf.json: the teacher-forced NLL of the text
      (tokenized by the directory's tokenizer as Transformers loads it, special tokens not
      parsed, BOS where the tokenizer adds one) per position, the argmax and the top-2
      margin, all in float32 on the CPU (eager attention). A bf16 directory is scored by
      Transformers in float32 on its bf16 weights (widened exactly on load), which is
      what ferrolm's CPU path computes with them too: the comparison measures the loader and
      the model, not bf16 arithmetic of one side.
  hf_corpus.py check ROOT CASE...
      Compares ROOT/CASE.hf.json with ROOT/CASE.ours.json (`ferrolm perplexity --json`) and
      prints one table row per case. Exits 1 when a case fails the gates: mean |ΔNLL| ≤
      0.01 nats and the argmax identical on ≥ 99% of the positions whose Transformers top-2
      margin > 0.05.

The models:
  llama   SmolLM2-135M-Instruct: the Q4_1 GGUF loaded by Transformers (dequantized to f32).
  gemma3  Gemma 3 270M (text): the Q4_K_M GGUF loaded the same way.
  gemma3-tiny, qwen3, qwen2
          Small models of random weights (synthetic: their text is gibberish), built from a
          Transformers config with a fixed seed, with SmolLM2's tokenizer (saved by
          Transformers from the GGUF). The weights are drawn so that the model is sensitive
          to every tensor (see `randomize`): gains around 1 ± 0.1, biases of std 0.5,
          logits of std ≈ 2.5, rather than Transformers' near-zero init, which gives nearly
          uniform logits that no loader defect would move.
An untied head of a real model is its embedding plus noise (std a quarter of the
embedding's), so that reading the embedding in its place would show. Cases with a RoPE
scaling set it in `rope_parameters`, as Transformers 5 writes it (no `rope_scaling`).
"""
import argparse
import copy
import json
import math
import os
import sys

# Where scripts/fetch-test-models.sh puts them.
GGUF_DIR = os.environ.get("FERROLM_MODELS") or os.path.join(
    os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm")), "models")
GGUF = {"llama": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}

# name: (arch, dtype, tied, max_shard_size or None, rope_parameters or None)
CASES = {
    "llama-f32": ("llama", "float32", True, None, None),
    "llama-bf16": ("llama", "bfloat16", True, None, None),
    "llama-bf16-untied": ("llama", "bfloat16", False, None, None),
    "llama-bf16-sharded": ("llama", "bfloat16", True, "50MB", None),
    # Llama 3's frequency-dependent scaling, with an original context short enough that it
    # changes most of SmolLM2's frequencies (at 8192 it would change almost none).
    "llama-f32-rope-llama3": ("llama", "float32", True, None, {
        "rope_type": "llama3", "rope_theta": 100000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "gemma3-bf16": ("gemma3", "bfloat16", True, None, None),
    "gemma3-f32-sharded": ("gemma3", "float32", True, "300MB", None),
    "gemma3-bf16-untied": ("gemma3", "bfloat16", False, None, None),
    # Gemma 3 4B-27B's form: linear scaling on the global layers only.
    "gemma3-bf16-rope-linear": ("gemma3", "bfloat16", True, None, {
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Past its sliding window (32 of the text's 273 positions), which the 270M's 512 is not.
    "gemma3-tiny-window": ("gemma3-tiny", "float32", True, None, None),
    "qwen3-f32-untied": ("qwen3", "float32", False, None, None),
    "qwen3-bf16": ("qwen3", "bfloat16", True, None, None),
    "qwen3-bf16-untied-sharded": ("qwen3", "bfloat16", False, "1MB", None),
    "qwen2-f32-untied": ("qwen2", "float32", False, None, None),
    "qwen2-bf16-sharded": ("qwen2", "bfloat16", True, "1MB", None),
    "qwen2-f32-rope-linear": ("qwen2", "float32", False, None, {
        "rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}),
}
SEED = {"qwen3": 3, "qwen2": 2, "gemma3-tiny": 4}


def random_config(arch, tied, rope):
    """A small config (4 layers, GQA 4:2, SmolLM2's 49152 ids). Qwen3's head_dim 48 is not
    hidden/heads (as in the real ones: 128 for hidden 1024 and 16 heads); the Gemma 3 one
    has a sliding window of 32, three sliding layers of four, and query_pre_attn_scalar 64
    for head_dim 32 (queries scaled by 1/8, not 1/√32)."""
    from transformers import Gemma3TextConfig, Qwen2Config, Qwen3Config

    kw = dict(vocab_size=49152, hidden_size=128, intermediate_size=320, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
              max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=None,
              eos_token_id=2, pad_token_id=None)
    if arch == "gemma3-tiny":
        types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        return Gemma3TextConfig(head_dim=32, query_pre_attn_scalar=64, sliding_window=32, layer_types=types, **kw)
    kw["rope_parameters"] = rope or {"rope_type": "default", "rope_theta": 1000000.0}
    return Qwen3Config(head_dim=48, **kw) if arch == "qwen3" else Qwen2Config(**kw)


def randomize(model, seed):
    """Seeded weights that make the output depend on every tensor: projections N(0, 1/in)
    (o_proj and down_proj half that, so the residual stream grows slowly), norm gains
    1 + N(0, 0.1²), biases N(0, 0.5²), embedding and head N(0, (2.5/√hidden)²) (logits of
    std ≈ 2.5). Gemma: its gain tensors hold the gain less 1, its embedding rows are
    multiplied by √hidden (drawn √hidden times smaller), and a tied head's scale comes from
    the final norm's gains (≈ √hidden)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h = model.config.hidden_size
    gemma = model.config.model_type == "gemma3_text"
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            n = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                centre = math.sqrt(h) if gemma and tied and name == "model.norm.weight" else 1
                v = centre * (1 + 0.1 * n) - (1 if gemma else 0)
            elif name.endswith(".bias"):
                v = 0.5 * n
            elif "embed_tokens" in name or name == "lm_head.weight":
                v = n * (2.5 / math.sqrt(h))
                if gemma and "embed_tokens" in name:
                    v = v / math.sqrt(h)
            else:
                v = n / math.sqrt(p.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    v = v * 0.5
            p.copy_(v)


def load_gguf(arch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = GGUF[arch]
    tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=name)
    m = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=name, dtype=torch.float32)
    return m, tok


def variant(base, tied, rope, seed):
    """A fresh model of base's config (with the GGUF quantizer's traces removed, which make
    save_pretrained refuse), tied or not, holding base's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(base.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.tie_word_embeddings = tied
    if rope:
        cfg.rope_parameters = dict(rope)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = {k: v for k, v in base.state_dict().items() if k != "lm_head.weight"}
    if not tied:
        e = sd["model.embed_tokens.weight"]
        g = torch.Generator().manual_seed(seed)
        sd["lm_head.weight"] = e + 0.25 * float(e.std()) * torch.randn(e.shape, generator=g)
    r = m.load_state_dict(sd, strict=False)
    assert not r.unexpected_keys, r.unexpected_keys
    assert set(r.missing_keys) <= ({"lm_head.weight"} if tied else set()), r.missing_keys
    if tied:
        m.tie_weights()
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    return m


def score(d, text):
    """Transformers' teacher-forced statistics on directory d, in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, (n, p.dtype)
    # ferrolm's perplexity: BOS where the tokenizer adds one, the text's special tokens not parsed.
    ids = tok(text, split_special_tokens=True).input_ids
    with torch.no_grad():
        lg = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    assert lg.dtype == torch.float32
    top2 = torch.topk(lg, 2, dim=-1)
    logp = torch.log_softmax(lg.double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return {
        "ids": ids,
        "nll": nll.tolist(),
        "argmax": top2.indices[:, 0].tolist(),
        "margin": (top2.values[:, 0] - top2.values[:, 1]).tolist(),
    }


def describe(d):
    """What Transformers wrote: the files and the config fields a loader must read."""
    cfg = json.load(open(os.path.join(d, "config.json")))
    files = sorted(os.listdir(d))
    keys = ["dtype", "torch_dtype", "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
            "layer_types", "sliding_window", "use_sliding_window", "attention_bias", "head_dim",
            "_sliding_window_pattern", "sliding_window_pattern", "query_pre_attn_scalar",
            "use_bidirectional_attention"]
    seen = {k: cfg[k] for k in keys if k in cfg}
    if "layer_types" in seen:
        lt = seen["layer_types"]
        seen["layer_types"] = f"{len(lt)} ({sum(t == 'sliding_attention' for t in lt)} sliding)"
    shards = [f for f in files if f.endswith(".safetensors")]
    return {"files": files, "shards": len(shards), "config": seen}


def build(a):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    assert int(transformers.__version__.split(".")[0]) >= 5, f"Transformers {transformers.__version__}: need 5.x"
    torch.set_num_threads(int(os.environ.get("HF_CORPUS_THREADS", os.cpu_count() or 1)))
    torch.manual_seed(0)
    text = open(a.text).read()
    cases = a.cases or list(CASES)
    for c in cases:
        if c not in CASES:
            sys.exit(f"unknown case {c!r} (known: {', '.join(CASES)})")
    os.makedirs(a.root, exist_ok=True)
    bases, smollm2_tok = {}, None
    for c in cases:
        arch, dtype, tied, shard, rope = CASES[c]
        synthetic = arch not in GGUF
        if synthetic:
            if smollm2_tok is None:
                smollm2_tok = bases["llama"][1] if "llama" in bases else load_gguf_tokenizer()
            tok = smollm2_tok
            torch.manual_seed(SEED[arch])
            model = AutoModelForCausalLM.from_config(random_config(arch, tied, rope), dtype=torch.float32)
            randomize(model, SEED[arch])
            if tied:
                model.tie_weights()
        else:
            if arch not in bases:
                # One GGUF in memory at a time.
                bases = {arch: load_gguf(arch)}
            base, tok = bases[arch]
            model = variant(base, tied, rope, seed=1)
        out = os.path.join(a.root, c)
        model.to(getattr(torch, dtype))
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(out, **kw)
        tok.save_pretrained(out)
        del model
        info = describe(out)
        if shard:
            assert info["shards"] > 1 and "model.safetensors.index.json" in info["files"], info
        s = score(out, text)
        ppl = math.exp(sum(s["nll"]) / len(s["nll"]))
        meta = {"case": c, "arch": arch, "synthetic": synthetic, "dtype": dtype, "tied": tied,
                "transformers": transformers.__version__, "torch": torch.__version__, "ppl": ppl, **info}
        json.dump({**meta, **s}, open(os.path.join(a.root, c + ".hf.json"), "w"))
        print(f"{c}: {info['shards']} shard(s), config {json.dumps(info['config'])}; "
              f"Transformers ppl {ppl:.4f} over {len(s['nll'])} positions", flush=True)


def load_gguf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF["llama"])


def check(a):
    rows, ok_all = [], True
    hdr = f"{'case':<28} {'weights':<10} {'shards':>6} {'tokens':>6} {'mean |dNLL|':>11} {'max |dNLL|':>10} {'argmax':>9} {'ppl ferrolm':>11} {'ppl HF':>9}"
    print(hdr)
    print("-" * len(hdr))
    for c in a.cases:
        h = json.load(open(os.path.join(a.root, c + ".hf.json")))
        o = json.load(open(os.path.join(a.root, c + ".ours.json")))
        if o["targets"] != h["ids"][1:]:
            print(f"{c:<28} FAIL: ferrolm and Transformers tokenize the text differently "
                  f"({len(o['targets'])} vs {len(h['ids']) - 1} targets)")
            ok_all = False
            continue
        d = [abs(x - y) for x, y in zip(o["nll"], h["nll"])]
        sure = [i for i, g in enumerate(h["margin"]) if g > 0.05]
        agree = sum(o["argmax"][i] == h["argmax"][i] for i in sure)
        mean = sum(d) / len(d)
        ppl_o, ppl_h = math.exp(sum(o["nll"]) / len(d)), math.exp(sum(h["nll"]) / len(d))
        ok = mean <= 0.01 and agree >= 0.99 * len(sure)
        ok_all &= ok
        weights = ("random " if h["synthetic"] else "") + {"float32": "f32", "bfloat16": "bf16"}[h["dtype"]]
        print(f"{c:<28} {weights:<10} {h['shards']:>6} {len(h['ids']):>6} {mean:>11.5f} {max(d):>10.5f} "
              f"{agree:>4}/{len(sure):<4} {ppl_o:>11.3f} {ppl_h:>9.3f}" + ("" if ok else "  FAIL"))
    sys.exit(0 if ok_all else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("root")
    b.add_argument("text")
    b.add_argument("cases", nargs="*")
    c = sub.add_parser("check")
    c.add_argument("root")
    c.add_argument("cases", nargs="+")
    sub.add_parser("list")
    a = ap.parse_args()
    if a.cmd == "list":
        print("\n".join(CASES))
    else:
        build(a) if a.cmd == "build" else check(a)


if __name__ == "__main__":
    main()
