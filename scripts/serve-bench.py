#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers (ferrolm serve, llama.cpp's llama-server,
vLLM): N concurrent clients each stream completions back to back for a fixed time or a
fixed number of requests; reports aggregate output tokens/s, time to first token and
inter-token latency percentiles, as JSON. Python standard library only, so it runs on the
GPU machine as it is.

  usage: scripts/serve-bench.py --url http://127.0.0.1:8080 --concurrency 1,8,32,64
             [--prompt-tokens 128] [--max-tokens 128] [--requests-per-client 4]
             [--model NAME] [--api-key KEY]

Each request is a /v1/completions stream with temperature 0 and `ignore_eos` (both
ferrolm and llama-server honour it), so every request generates max_tokens tokens. Tokens
are counted from the final usage chunk when the server sends one
(stream_options.include_usage), else one per streamed chunk with text. The prompt is a
fixed English text cut to about --prompt-tokens words, different per client so no prefix
cache serves it.
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
    """One streamed completion: (seconds to first token, gaps between tokens, tokens)."""
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
            usage = ev["usage"].get("completion_tokens")
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
    return first, gaps, usage if usage is not None else chunks


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
                f, g, n = stream_once(args.url, body, headers)
            except Exception as e:  # a failed request is reported, not fatal
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                ttft.append(f)
                itl.extend(g)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

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
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
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
