#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers (ferrolm serve, llama.cpp's llama-server,
vLLM): N concurrent clients each stream completions back to back for a fixed time or a
fixed number of requests; reports aggregate output tokens/s, time to first token and
inter-token latency percentiles, as JSON. Python standard library only, so it runs on the
GPU machine as it is.

  usage: scripts/serve-bench.py --url http://127.0.0.1:8080 --concurrency 1,8,32,64
             [--prompt-tokens 128] [--max-tokens 128] [--requests-per-client 4]
             [--model NAME] [--api-key KEY]
         scripts/serve-bench.py --url ... --prefix-words 2000 [--repeats 3]

Each request is a /v1/completions stream with temperature 0 and `ignore_eos` (both
ferrolm and llama-server honour it), so every request generates max_tokens tokens. Tokens
are counted from the final usage chunk when the server sends one
(stream_options.include_usage), else one per streamed chunk with text. The prompt is a
fixed English text cut to about --prompt-tokens words, different per client so no prefix
cache serves it.

--prefix-words N measures the prefix cache instead: per repeat, a request with a new
N-word prefix and one question (cold), then one with the same prefix and another question
(the prefix cached); it reports both times to first token, their ratio, and the second
request's usage.prompt_tokens_details.cached_tokens.

Against ferrolm each level also reports the engine's mean step and the part of it spent in
forward calls (from /metrics' ferrolm_engine_* counters): the rest of a step is the host's.
"""
import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "judge boxing matches near the old river bank and sing").split()


def prompt_for(client, n_words):
    return f"Client {client}: " + " ".join(WORDS[(client + i) % len(WORDS)] for i in range(n_words))


def stream_once(url, body, headers):
    """One streamed completion: (seconds to first token, gaps between tokens, tokens, the
    final usage object or None)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first, last, gaps, chunks, usage = None, None, [], 0, None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        text = "".join(c.get("text") or "" for c in ev.get("choices") or [])
        if not text:
            continue
        now = time.perf_counter()
        if first is None:
            first = now - t0
        else:
            gaps.append(now - last)
        last = now
        chunks += 1
    conn.close()
    if first is None:
        raise RuntimeError("the stream carried no text")
    tokens = usage.get("completion_tokens", chunks) if usage else chunks
    return first, gaps, tokens, usage


def engine_counters(url):
    """ferrolm's engine step counters from /metrics ({} from servers without them)."""
    names = ("ferrolm_engine_steps_total", "ferrolm_engine_step_seconds_total", "ferrolm_engine_forward_seconds_total")
    try:
        u = urllib.parse.urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            out[parts[0]] = float(parts[1])
    return out if len(out) == len(names) else {}


def step_costs(before, after):
    """Mean engine step and forward-call milliseconds between two engine_counters."""
    if not before or not after:
        return None
    steps = after["ferrolm_engine_steps_total"] - before["ferrolm_engine_steps_total"]
    if steps <= 0:
        return None
    ms = lambda k: 1e3 * (after[k] - before[k]) / steps
    return {"steps": int(steps), "step_ms": ms("ferrolm_engine_step_seconds_total"),
            "forward_ms": ms("ferrolm_engine_forward_seconds_total")}


def run_level(args, concurrency):
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    ttft, itl, tokens, errors = [], [], [0], []
    lock = threading.Lock()

    def client(i):
        body = {"prompt": prompt_for(i, args.prompt_tokens), "max_tokens": args.max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        if args.model:
            body["model"] = args.model
        for _ in range(args.requests_per_client):
            try:
                f, g, n, _ = stream_once(args.url, body, headers)
            except Exception as e:  # a failed request is reported, not fatal
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                ttft.append(f)
                itl.extend(g)
                tokens[0] += n

    counters = engine_counters(args.url)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    engine = step_costs(counters, engine_counters(args.url))

    def pct(xs, p):
        if not xs:
            return None
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    return {
        "concurrency": concurrency,
        "requests": len(ttft),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": tokens[0],
        "seconds": wall,
        "output_tokens_per_s": tokens[0] / wall,
        "ttft_s": {f"p{p}": pct(ttft, p) for p in (50, 90, 99)},
        "itl_s": {f"p{p}": pct(itl, p) for p in (50, 90, 99)},
        "itl_mean_s": statistics.fmean(itl) if itl else None,
        # ferrolm only: the engine's mean step, and the forward call's part of it.
        "engine": engine,
    }


def prefix_test(args):
    """Cold and prefix-cached time to first token, `args.repeats` times (median ratio)."""
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    runs = []
    for r in range(args.repeats):
        prefix = f"Document {r}: " + " ".join(WORDS[(r * 7 + i * 3) % len(WORDS)] for i in range(args.prefix_words))
        times = []
        for question in ("What is the first word?", "How many wizards are there?"):
            body = {"prompt": f"{prefix}\nQuestion: {question}\nAnswer:", "max_tokens": 4, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            f, _, _, usage = stream_once(args.url, body, headers)
            usage = usage or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            times.append((f, usage.get("prompt_tokens"), cached))
        (cold, prompt, _), (hit, _, cached) = times
        runs.append({"ttft_cold_s": cold, "ttft_cached_s": hit, "ratio": cold / hit, "prompt_tokens": prompt,
                     "cached_tokens": cached})
    ratios = sorted(x["ratio"] for x in runs)
    return {"url": args.url, "prefix_words": args.prefix_words, "runs": runs,
            "median_ratio": ratios[len(ratios) // 2]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--prefix-words", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.prefix_words:
        json.dump(prefix_test(args), sys.stdout, indent=1)
        print()
        return
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if not levels or min(levels) < 1:
        sys.exit("--concurrency: a comma-separated list of positive counts")
    out = [run_level(args, c) for c in levels]
    json.dump({"url": args.url, "prompt_words": args.prompt_tokens, "max_tokens": args.max_tokens,
               "levels": out}, sys.stdout, indent=1)
    print()
    if any(level["errors"] for level in out):
        sys.exit(1)


if __name__ == "__main__":
    main()
