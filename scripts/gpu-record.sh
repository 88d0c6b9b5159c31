#!/usr/bin/env bash
# A GPU record in one call (issue 36): the tests marked `cuda` on the device, then exitspec/bench/gpu_record.py
# (random-weight Qwen3-4B/8B-shaped targets and a DFlash-shaped drafter, built on the device; no downloads).
#
#   bash scripts/gpu-record.sh                       # on a lent GPU: writes data/bench/gpu-<device>/
#   bash scripts/gpu-record.sh --tiny --device cpu   # CI: the same steps at tiny shapes on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda tiny=""
tau_from=data/bench/smollm2-135m-instruct/llamacpp-zen1/bfloat16/results.jsonl  # τ of a real run, projected
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=--tiny ;;
    --device) device="$2"; shift ;;
    --out) out="$2"; shift ;;
    *) echo "gpu-record.sh: unknown option $1 (use --tiny, --device DEVICE, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "${out:-}" ]; then
  name=$(python -c "import torch; print(torch.cuda.get_device_name() if '$device'.startswith('cuda') else 'cpu')" |
         tr 'A-Z ' 'a-z-')
  out="data/bench/gpu-${name}${tiny:+-tiny}"
fi
mkdir -p "$out"
{
  echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) device=$device $tiny"
  EXITSPEC_TEST_DEVICE="$device" python -m pytest -q -m cuda tests/test_device.py
  python -m exitspec.bench.gpu_record --device "$device" $tiny --out "$out" --tau-from "$tau_from"
} 2>&1 | tee "$out/log.txt"
