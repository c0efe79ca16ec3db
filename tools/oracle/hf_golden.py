#!/usr/bin/env python3
"""Reference goldens for a GGUF model (SmolLM2-135M-Instruct, Gemma 3 270M) from Hugging Face Transformers.

Purpose
-------
ferrolm must reproduce the numerics of an independent implementation. This script
loads the *same* GGUF file ferrolm runs, through Transformers' GGUF loader (which
dequantizes every tensor to float32 and builds its own tokenizer from the GGUF
metadata), and records:

* ``texts``: four teacher-forcing texts (prose, Python code, facts with numbers,
  a chat-template conversation). For each: token ids and, for every predicted
  position ``i`` (predicting ``ids[i+1]`` from ``ids[..=i]`` with full causal
  context), ``nll`` (-log softmax of the target), ``argmax`` (top-1 id) and
  ``margin`` (top-1 minus top-2 logit; identical in log-prob units).
  Tokenization follows ferrolm's perplexity: prose/code/facts are plain text
  with special-token parsing OFF; the chat text is parsed WITH special tokens.
  BOS is prepended where the tokenizer adds one by default (Gemma: yes; SmolLM2's
  GGUF says ``add_bos_token = false``). Chat texts are tokenized as
  ``apply_chat_template`` does: the template writes its own BOS, nothing is added.
* ``perplexity``: exp(mean nll) for each text.
* ``greedy``: five chat prompts rendered with ``apply_chat_template(...,
  add_generation_prompt=True)``, tokenized with special tokens parsed, then
  greedily decoded for exactly 48 new tokens (EOS does not stop decoding;
  ``first_eos_index`` records where EOS first appeared in the continuation, or
  null). Decoding recomputes the full prefix each step (no KV cache) in f32;
  ``margins`` gives the top-1/top-2 logit gap per step so consumers can see
  which steps are near-ties and fragile under different summation orders.

All model arithmetic is float32 (eager attention, 1 thread). The log-softmax,
argmax and margins are taken from the float32 logits (log-softmax evaluated in
float64 on those f32 logits so the reference adds no extra rounding).
Floats are rounded to 6 significant digits; the JSON is written compactly.

How to run
----------
    pip install torch transformers gguf accelerate numpy   # accelerate: GGUF loading
    python3 tools/oracle/hf_golden.py \
        [--model /root/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf] \
        [--out crates/engine/tests/goldens/smollm2_hf.json]
    python3 tools/oracle/hf_golden.py \
        --model /root/.cache/ferrolm/models/gemma-3-270m-q4_k_m.gguf \
        --chat-template gemma3 --expect "" --long \
        --out crates/engine/tests/goldens/gemma3_hf.json

``--chat-template gemma3`` gives the tokenizer Gemma 3's published chat format, for
GGUFs that carry no template (this one); ``--expect ""`` skips the coherence check
(the 270M GGUF is the pretrained model, not the instruction-tuned one).

Takes ~1-2 minutes on one CPU thread. Re-running produces identical output
except for ``metadata.date``.
"""

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import sys

import numpy as np
import torch

DEFAULT_MODEL = "/root/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..", "..", "crates", "engine", "tests", "goldens", "smollm2_hf.json",
)
N_NEW = 48

# Gemma 3's chat format as Google publishes it in tokenizer_config.json (string contents):
# the system message prefixes the first user turn, the assistant's role is "model".
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
TEMPLATES = {"gemma3": GEMMA3_TEMPLATE}

PROSE = (
    "The history of the lighthouse is closely tied to the history of seafaring itself. "
    "Long before electric lamps and rotating lenses, coastal communities lit fires on hilltops "
    "to warn sailors away from dangerous rocks and to guide them safely into harbor. The most "
    "famous early example was the Pharos of Alexandria, built in the third century BC on a small "
    "island at the mouth of the city's harbor. Ancient writers described it as a tower of white "
    "stone, so tall that its light could be seen from many miles out at sea. For centuries it "
    "stood as one of the wonders of the ancient world, until a series of earthquakes finally "
    "brought it down. In the centuries that followed, lighthouse design changed slowly. Most "
    "towers burned wood or coal in open braziers, which produced a great deal of smoke and "
    "relatively little light. The real breakthrough came in the early nineteenth century, when "
    "the French physicist Augustin Fresnel developed a new kind of lens made of concentric rings "
    "of glass prisms. His design bent and focused the light from a single lamp into a powerful "
    "horizontal beam, and it was far lighter and cheaper than a solid lens of the same size. "
    "Within a few decades, Fresnel lenses had been installed along coastlines all over the world, "
    "and many of them remain in service today, although most lighthouses are now fully automated "
    "and no longer need a keeper living on site."
)

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


print(merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]]))
'''

FACTS = (
    "Some facts about the solar system:\n"
    "1. The Sun contains about 99.86% of the total mass of the solar system.\n"
    "2. Jupiter has 95 officially recognized moons as of 2023.\n"
    "3. Light from the Sun takes roughly 8 minutes and 20 seconds to reach Earth.\n"
    "4. A day on Venus lasts 243 Earth days, longer than its year of 225 days.\n"
)

CHAT_MESSAGES = [
    {"role": "user", "content": "Can you suggest a name for my new orange cat?"},
    {"role": "assistant", "content": "Of course! How about \"Marmalade\"? It suits an orange cat and sounds friendly."},
    {"role": "user", "content": "I like it. What should I feed her in the first week?"},
    {"role": "assistant", "content": "Keep feeding the same food the shelter used, offer fresh water at all times, and change her diet slowly over a week or two if you want to switch brands."},
]

GREEDY_PROMPTS = [
    ("factual", "What is the tallest mountain in the world, and how tall is it?"),
    ("instruction", "Rewrite this sentence in the passive voice: The dog chased the ball."),
    ("math", "A baker makes 12 muffins per tray and bakes 7 trays. She sells 59 muffins. How many muffins are left?"),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
    ("creative", "Write a one-line poem about the ocean at night."),
]


def r6(x):
    """Round to 6 significant digits (returns a float JSON can print compactly)."""
    x = float(x)
    if x == 0.0 or not math.isfinite(x):
        return x
    return float(f"{x:.6g}")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(os.path.abspath(model_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, (n, p.dtype)
    return tok, model


@torch.no_grad()
def logits_for(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=x, use_cache=False)
    lg = out.logits[0]
    assert lg.dtype == torch.float32
    return lg


def position_stats(lg):
    """Per-position argmax, top-2 margin and float64 log-softmax of f32 logits."""
    top2 = torch.topk(lg, 2, dim=-1)
    argmax = top2.indices[:, 0]
    margin = top2.values[:, 0] - top2.values[:, 1]
    logp = torch.log_softmax(lg.double(), dim=-1)
    return argmax, margin, logp


def teacher_forcing(model, ids):
    lg = logits_for(model, ids)
    argmax, margin, logp = position_stats(lg[:-1])
    tgt = torch.tensor(ids[1:], dtype=torch.long)
    nll = -logp.gather(1, tgt[:, None])[:, 0]
    ppl = math.exp(float(nll.mean()))
    return {
        "nll": [r6(v) for v in nll.tolist()],
        "argmax": [int(v) for v in argmax.tolist()],
        "margin": [r6(v) for v in margin.tolist()],
        "mean_nll": r6(float(nll.mean())),
    }, ppl


@torch.no_grad()
def greedy(model, prompt_ids, n_new, eos_id):
    ids = list(prompt_ids)
    cont, margins = [], []
    for _ in range(n_new):
        lg = logits_for(model, ids)[-1:]
        top2 = torch.topk(lg[0], 2)
        nxt = int(top2.indices[0])
        margins.append(r6(float(top2.values[0] - top2.values[1])))
        cont.append(nxt)
        ids.append(nxt)
    first_eos = cont.index(eos_id) if eos_id in cont else None
    return cont, margins, first_eos


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--chat-template", choices=sorted(TEMPLATES), help="for a GGUF without one")
    ap.add_argument("--expect", default="Paris", help="word the sanity reply must hold ('' skips)")
    ap.add_argument("--long", action="store_true",
                    help="add a ~1000-token text (past Gemma 3's 512-position sliding window)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)

    import transformers
    import gguf

    tok, model = load(args.model)
    if args.chat_template:
        tok.chat_template = TEMPLATES[args.chat_template]
    eos_id = tok.eos_token_id
    bos_id = tok.bos_token_id
    # Whether the tokenizer adds BOS by default; nothing else may be added.
    plain = tok("hello", add_special_tokens=False).input_ids
    add_bos = tok("hello").input_ids != plain
    assert tok("hello").input_ids == ([bos_id] if add_bos else []) + plain, "tokenizer adds more than BOS"

    # Sanity: the model must answer coherently.
    sanity_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    s_ids = tok(sanity_prompt, add_special_tokens=False).input_ids
    s_cont, _, _ = greedy(model, s_ids, 12, eos_id)
    s_text = tok.decode(s_cont)
    print("sanity reply:", repr(s_text), file=sys.stderr)
    assert args.expect in s_text, "model output is not coherent; GGUF load is broken"

    chat_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=False, tokenize=False)
    texts_spec = [
        ("prose", PROSE, False),
        ("code", CODE, False),
        ("facts", FACTS, False),
        ("chat", chat_text, True),
    ]
    if args.long:
        # Twice the three plain texts: the second copy can be predicted from the first,
        # more than a sliding window back, only through the global layers.
        texts_spec.append(("long", ("\n\n".join([PROSE, CODE, FACTS]) + "\n\n") * 2, False))

    texts, perplexity = [], {}
    for name, text, parse_special in texts_spec:
        # Plain texts as the tokenizer encodes them by default; the chat text as
        # apply_chat_template does (its template writes any BOS).
        ids = tok(text, split_special_tokens=not parse_special, add_special_tokens=not parse_special).input_ids
        stats, ppl = teacher_forcing(model, ids)
        perplexity[name] = r6(ppl)
        texts.append({
            "name": name,
            "parse_special": parse_special,
            "text": text,
            "n_tokens": len(ids),
            "ids": ids,
            **stats,
            "perplexity": r6(ppl),
        })
        print(f"{name}: {len(ids)} tokens, ppl {ppl:.4f}", file=sys.stderr)

    greedy_out = []
    for name, user in GREEDY_PROMPTS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tok(prompt, add_special_tokens=False).input_ids
        cont, margins, first_eos = greedy(model, p_ids, N_NEW, eos_id)
        greedy_out.append({
            "name": name,
            "user": user,
            "prompt": prompt,
            "prompt_ids": p_ids,
            "continuation_ids": cont,
            "continuation_text": tok.decode(cont),
            "first_eos_index": first_eos,
            "margins": margins,
        })
        print(f"greedy {name}: eos@{first_eos} {tok.decode(cont[:first_eos])!r}", file=sys.stderr)

    golden = {
        "metadata": {
            "generator": "tools/oracle/hf_golden.py",
            "model_file": os.path.basename(args.model),
            "model_sha256": sha256(args.model),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": getattr(gguf, "__version__", None) or _pkg_version("gguf"),
            "numpy": np.__version__,
            "python": platform.python_version(),
            "dtype": "float32",
            "attn_implementation": "eager",
            "threads": 1,
            "date": datetime.date.today().isoformat(),
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "add_bos": add_bos,
            "chat_template": args.chat_template,
            "float_rounding": "6 significant digits",
            "nll_definition": "nll[i] = -log_softmax(logits[i])[ids[i+1]], logits from ids[..=i] with full causal context",
            "margin_definition": "top1 logit - top2 logit (same in log-prob units)",
            "greedy_definition": f"{N_NEW} new tokens, argmax each step, no stop at EOS, full-prefix recompute (no KV cache)",
            "sanity_reply": s_text,
        },
        "texts": texts,
        "perplexity": perplexity,
        "greedy": greedy_out,
    }
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(golden, f, separators=(",", ":"), ensure_ascii=False)
        f.write("\n")
    print(f"wrote {out} ({os.path.getsize(out)} bytes)", file=sys.stderr)


def _pkg_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


if __name__ == "__main__":
    main()
