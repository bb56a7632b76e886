#!/bin/bash
# A/B of jax 0.12.0.1 (/tmp/j121/.venv, same sources at 3ca0cef) vs 0.12.1 (/work/main/.venv), alternating
cd /tmp/ab_jax
for r in 1 2; do
  for side in old new; do
    if [ $side = old ]; then BIN=/tmp/j121/.venv/bin; else BIN=/work/main/.venv/bin; fi
    $BIN/magicpig-jax bench decode --lengths 1024 8192 --batch 1 4 --methods dense magicpig --steps 32 --repeats 3 --warmup 1 --kv-dtype bfloat16 --out /tmp/ab_jax/${side}_r$r > /tmp/ab_jax/${side}_r$r.log 2>&1
    echo "$side r$r rc=$? $(date -u +%H:%M:%S)"
  done
done
