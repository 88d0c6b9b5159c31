#!/usr/bin/env bash
# arm A (523c830) then arm B (this commit): bench, 5 prompts of each Table 1 set, T=0 and T=1, auto, no warm start
set -e
for arm in before main; do
  if [ $arm = before ]; then repo=/tmp/before; else repo=/work/main; fi
  out=/tmp/ab-$arm; rm -rf $out
  (cd $repo && PYTHONPATH=$repo EXITSPEC_DATA=/work/shared/data python -m exitspec bench --datasets mtbench humaneval gsm8k math500 \
     --num-prompts 3 --budgets auto --temperatures 0 1 --threads 2 --no-warm-start --out $out --no-progress) > /tmp/ab-$arm.log 2>&1 || echo "arm $arm failed"
  date
done
