#!/usr/bin/env bash
# All of ferrolm's tests: the Rust test suite (parity with committed goldens, exact codec
# tests, bad-input tests, CLI tests) and the proof that mlx-lm loads `ferrolm convert` output.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-models.sh
cargo test --workspace --release
scripts/mlx-check.sh
