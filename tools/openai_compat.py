#!/usr/bin/env python3
"""The official `openai` Python client against `ferrolm serve`: a compatibility test.

Starts `ferrolm serve` on a free port with the SmolLM2 test model on the CPU, then uses
openai.OpenAI(base_url=..., api_key=...) for chat and completions, whole and streamed,
stop sequences, log-probabilities, usage and errors; stops the server with SIGTERM and
wants exit status 0. Exits non-zero on the first mismatch.

    python3 tools/openai_compat.py [--bin target/release/ferrolm] [--model FILE]
"""

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading

import openai

KEY = "sk-compat-test"
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]
PROMPT = "The three primary colors are"


def default_model():
    home = os.environ.get("FERROLM_HOME", str(pathlib.Path.home() / ".cache" / "ferrolm"))
    models = os.environ.get("FERROLM_MODELS", os.path.join(home, "models"))
    return os.path.join(models, "SmolLM2-135M-Instruct.Q4_1.gguf")


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def start(binary, model, log):
    """`ferrolm serve` on port 0; its address from the first line it prints."""
    proc = subprocess.Popen(
        [binary, "serve", "--model", model, "--device", "cpu", "--port", "0", "--api-key", KEY],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    timer = threading.Timer(120, proc.kill)  # a server that never starts ends the test
    timer.start()
    line = proc.stdout.readline()
    timer.cancel()
    if "http://" not in line:
        proc.kill()
        proc.wait()
        log.seek(0)
        sys.exit(f"openai_compat: ferrolm serve did not start (printed {line!r}); its log:\n{log.read()}")
    return proc, line.strip().rsplit("http://", 1)[1]


def chat_text(client, **kw):
    return client.chat.completions.create(model="m", messages=CHAT, temperature=0, max_tokens=24, **kw)


def test_models(client):
    models = client.models.list().data
    check(len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct.Q4_1", f"models: {models}")


def test_chat(client):
    whole = chat_text(client)
    text = whole.choices[0].message.content
    check("Paris" in text, f"chat text: {text!r}")
    check(whole.object == "chat.completion" and whole.choices[0].message.role == "assistant", whole)
    u = whole.usage
    check(u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, u)
    check(u.prompt_tokens_details.cached_tokens == 0, u)
    chunks = list(chat_text(client, stream=True, stream_options={"include_usage": True}))
    check(chunks[0].choices[0].delta.role == "assistant", chunks[0])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(streamed == text, f"streamed chat {streamed!r} != {text!r}")
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check(finish == [whole.choices[0].finish_reason], finish)
    check(chunks[-1].choices == [] and chunks[-1].usage == u, f"{chunks[-1].usage} != {u}")


def test_completions(client):
    whole = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=32)
    text = whole.choices[0].text
    check(text and whole.object == "text_completion", whole)
    stream = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=32, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    check(streamed == text, f"streamed completion {streamed!r} != {text!r}")
    return text


def test_stops(client, full):
    word = full.split()[2]
    want = full[: full.index(word)]
    for stream in (False, True):
        r = client.completions.create(
            model="m", prompt=PROMPT, temperature=0, max_tokens=32, stop=["never-here", word], stream=stream
        )
        if stream:
            parts = [c.choices[0] for c in r if c.choices]
            text, finish = "".join(p.text for p in parts), [p.finish_reason for p in parts if p.finish_reason]
        else:
            text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        check((text, finish) == (want, ["stop"]), f"stop {word!r} (stream={stream}): {text!r} {finish}")


def test_logprobs(client):
    r = chat_text(client, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    check("".join(t.token for t in content) == r.choices[0].message.content, "chat logprob tokens")
    for t in content:
        check(t.logprob <= 0 and bytes(t.bytes) == t.token.encode() and len(t.top_logprobs) == 2, t)
        check(t.top_logprobs[0].token == t.token, f"greedy token is not the most probable: {t}")
    c = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=8, logprobs=2)
    lp = c.choices[0].logprobs
    check("".join(lp.tokens) == c.choices[0].text, "completion logprob tokens")
    check(len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens), lp)


def test_errors(client, base_url):
    try:
        openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0).models.list()
        check(False, "a wrong key was accepted")
    except openai.AuthenticationError:
        pass
    try:
        client.chat.completions.create(model="m", messages=CHAT, n=2)
        check(False, "n=2 was accepted")
    except openai.BadRequestError as e:
        check(e.body and e.body.get("param") == "n", e.body)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/ferrolm")
    ap.add_argument("--model", default=default_model())
    a = ap.parse_args()
    if not os.path.exists(a.bin):
        sys.exit(f"openai_compat: {a.bin} is missing (build it: cargo build --release)")
    # The server's log is shown only when something fails.
    log = tempfile.TemporaryFile(mode="w+")
    proc, addr = start(a.bin, a.model, log)
    base_url = f"http://{addr}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=300)
    tests = [
        lambda: test_models(client),
        lambda: test_chat(client),
        lambda: test_stops(client, test_completions(client)),
        lambda: test_logprobs(client),
        lambda: test_errors(client, base_url),
    ]
    try:
        for t in tests:
            t()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        check(code == 0, f"ferrolm serve exited {code} on SIGTERM")
    except Exception:
        proc.kill()
        proc.wait()
        log.seek(0)
        sys.stderr.write("ferrolm serve's log:\n" + log.read())
        raise
    print(f"openai_compat: all {len(tests)} checks passed against {addr} (openai {openai.__version__})")


if __name__ == "__main__":
    main()
