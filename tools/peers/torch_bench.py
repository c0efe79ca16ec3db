#!/usr/bin/env python3
"""PyTorch peer for `ferrolm bench --device cuda`: Hugging Face Transformers in bf16 with a
static KV cache and torch.compile, at the shapes we benchmark (random weights: speed only).

    python3 tools/peers/torch_bench.py --shape smollm2-135m --prompt 512 --gen 128

Prints one JSON line: prefill_tps (prompt tokens / prefill time) and decode_tps (generated
tokens after the first / decode time), medians over --repeats runs after a warm-up.
"""
import argparse, json, statistics, time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

SHAPES = {
    # hidden, layers, heads, kv heads, ffn, vocab, tied, rope theta
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, True, 100000.0),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256, True, 500000.0),
}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=SHAPES)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    h, L, nh, nkv, f, V, tied, theta = SHAPES[a.shape]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=L, num_attention_heads=nh, num_key_value_heads=nkv,
                      intermediate_size=f, vocab_size=V, tie_word_embeddings=tied, rope_theta=theta,
                      max_position_embeddings=a.prompt + a.gen + 8, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ctx = a.prompt + a.gen
    cache = StaticCache(config=cfg, max_batch_size=1, max_cache_len=ctx, device="cuda", dtype=torch.bfloat16)
    decode = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, V, (1, a.prompt), device="cuda")

    def run():
        cache.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            pos = torch.arange(a.prompt, device="cuda")
            out = model(ids, cache_position=pos, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            for i in range(a.gen - 1):
                pos = torch.tensor([a.prompt + i], device="cuda")
                out = decode(tok, cache_position=pos, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        return a.prompt / (t1 - t0), (a.gen - 1) / (t2 - t1)

    run()  # warm-up: compiles and captures
    runs = [run() for _ in range(a.repeats)]
    print(json.dumps({"engine": "torch " + torch.__version__, "shape": a.shape, "prompt_tokens": a.prompt,
                      "gen_tokens": a.gen, "prefill_tps": statistics.median(r[0] for r in runs),
                      "decode_tps": statistics.median(r[1] for r in runs), "runs": runs}))

if __name__ == "__main__":
    main()
