#!/usr/bin/env python3
"""The executable of test target NAME from `cargo test --no-run --message-format=json` on
stdin; exits non-zero unless exactly one was built (scripts/test.sh, scripts/gpu-stage.sh).

    cargo test ... --no-run --message-format=json | python3 scripts/test-exe.py NAME
"""
import json
import sys

name = sys.argv[1]
exe = [j["executable"] for j in map(json.loads, sys.stdin)
       if j.get("executable") and j.get("target", {}).get("name") == name]
if len(exe) != 1:
    sys.exit(f"test-exe.py: {len(exe)} {name} test binaries")
print(exe[0])
