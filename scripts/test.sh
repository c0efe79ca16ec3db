#!/usr/bin/env bash
# All of ferrolm's tests: the Rust test suite (parity with committed goldens, exact codec
# tests, bad-input tests, CLI tests, the HTTP server's tests, every CUDA kernel compiled with
# NVRTC for sm_90), the official openai Python client against `ferrolm serve`, and the proof
# that mlx-lm loads `ferrolm convert` output. Needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-models.sh
# NVRTC for the kernel compile test.
source scripts/nvrtc-env.sh
# The tests need no debug info (release builds have debug = 1, Cargo.toml): without
# it a fresh build of every test target took 297 s here against 331 s, and its target
# directory 664 MiB against 2.6 GiB.
export CARGO_PROFILE_RELEASE_DEBUG=0
# And opt-level 2, not release's 3: the engine's build (twice: the library and its unit
# tests) took 162 s of CPU at 2 against 321 at 3 here; the tests ran as fast (rustc
# keeps float semantics at every level, so the bits are the same), and the whole script
# from an empty target directory 22.5 minutes against ~23.7 (perf-log.md Session 62). The
# binaries it leaves in target/release are these: `cargo build --release` before timing.
export CARGO_PROFILE_RELEASE_OPT_LEVEL=2
# Every build here has one feature set, so the engine compiles once: `cuda-tests` only adds
# the GPU test target (required-features), which must compile here and runs only on a GPU
# (scripts/gpu-check.sh). So the run names every other test target (from cargo metadata,
# which finds new ones by itself) instead of building the engine twice.
features=(--features ferrolm-engine/cuda-tests)
# (An assignment, so that a failing cargo metadata stops the script; an empty list would
# silently run the unit tests alone.)
listed=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
names = {t["name"] for p in json.load(sys.stdin)["packages"] for t in p["targets"]
         if "test" in t["kind"] and "cuda-tests" not in t.get("required-features", [])}
if not names:
    sys.exit("scripts/test.sh: cargo metadata lists no test targets")
for n in sorted(names):
    print("--test"); print(n)')
mapfile -t tests <<< "$listed"
# Build every test target, then run the NVRTC compile test (~3 minutes of both cores) in the
# background beside the others: most targets leave a core idle (a long test of its own at
# the end, single-threaded model loads), so together they take less wall time than in turn
# (the whole script 748 s against 792 s here, the build present; perf-log.md Session 47).
# The GPU test target (cuda_parity) builds here too, beside the others, and does not run.
kc_bin=$(cargo test --workspace --release "${features[@]}" --lib --bins "${tests[@]}" --test cuda_parity --no-run \
  --message-format=json | python3 scripts/test-exe.py kernels_compile)
kc_log=$(mktemp)
(cd crates/engine && "$kc_bin") >"$kc_log" 2>&1 &
kc_pid=$!
trap 'kill "$kc_pid" 2>/dev/null || true' EXIT  # a failure below stops it too
others=()
for ((i = 0; i < ${#tests[@]}; i += 2)); do
  [[ ${tests[i + 1]} == kernels_compile ]] || others+=("${tests[i]}" "${tests[i + 1]}")
done
cargo test --workspace --release "${features[@]}" --lib --bins "${others[@]}"
cargo test --workspace --release "${features[@]}" --doc
echo "kernels_compile (run in the background):"
kc_status=0
wait "$kc_pid" || kc_status=$?
trap - EXIT
cat "$kc_log"
rm -f "$kc_log"
[[ $kc_status == 0 ]] || { echo "scripts/test.sh: kernels_compile failed ($kc_status)" >&2; exit 1; }
# The official openai Python client against `ferrolm serve` (tools/openai_compat.py).
python3 -c "import openai" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check openai
# The CLI in the tests' feature set (already built for tests/cli.rs: a no-op), for the scripts
# below: `cargo build -p ferrolm-cli` alone would compile the engine again without them.
cargo build --workspace --release "${features[@]}" --bin ferrolm
export FERROLM=${CARGO_TARGET_DIR:-target}/release/ferrolm
python3 tools/openai_compat.py --bin "$FERROLM"
scripts/mlx-check.sh
# mlx-lm's own converter against ferrolm's NLL: an odd bit width and a mixed recipe (the
# whole matrix of bits × groups × recipes: scripts/mlx-corpus.sh with no arguments).
scripts/mlx-corpus.sh 3:32 mixed_4_6
