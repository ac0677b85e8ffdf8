#!/usr/bin/env bash
# GPU check for a lent CUDA machine (written for the H200 device tool: ~8 minutes at most).
#
# The device machine has no network and its own python3 (torch with CUDA, Triton, transformers,
# pytest). What travels with the repo (64 MiB in all), prepared on the CPU machine:
#   .whl/          wheels of the server's other dependencies for that python (pyzmq, msgspec,
#                  fastapi, starlette, pydantic(-core), uvicorn, xgrammar, apache-tvm-ffi,
#                  outlines-core, opentelemetry-api, typing-extensions, annotated-doc; for step 9
#                  openai, httpx2, httpcore2, jiter, truststore, sniffio, idna, jsonschema,
#                  jsonschema-specifications, referencing, rpds-py: 14 MB in all);
#                  see /work/.library/device/README.md for the `pip download` line;
#   .gpu_carry/SmolLM2-135M-Instruct/  config.json, tokenizer and chat template of the default
#                  model. Its weights cannot travel (517 MB float32; 94 MB even as Q4_1 GGUF), so
#                  step 4 gives that exact architecture RANDOM weights (seeded): every result that
#                  uses it is a speed or an equality-with-transformers result, never model quality.
#
# Steps, each under its own timeout (cut to what is left of $GPU_CHECK_BUDGET_S, default 540 s),
# carrying on after a failure; the order is by priority:
#   1. the machine (nvidia-smi, python, torch, triton);
#   2. import path: the wheels into /tmp/site, and links splitserve/<component> -> ../<component>
#      (what pyproject's package-dir does for `pip install -e`);
#   3. Triton kernel tests and CUDA-graph decode tests, compiled and captured on CUDA; then the
#      weight-only int8/int4 Triton products (tests/engine/test_triton_quant_matmul.py, so far
#      run only under Triton's CPU interpreter);
#   4. the SmolLM2-shaped random model; its greedy tokens on CUDA (Triton backend, float32) equal
#      transformers' (tests/engine/test_default_model_vs_hf.py pointed at it); then its decode
#      step, bf16 weights vs --quantization int8 / int4 on the Triton products
#      (bench/quant_decode_step.py --device cuda; the ratios are in logs.txt);
#   5. bench/serving.py on the same GPU: transformers `generate` on static batches (bf16) against
#      a colocated splitserve cluster with CUDA graphs (bf16), concurrency 1 and 32;
#   6. the same cluster without CUDA graphs (--disable-cuda-graph): what capture buys;
#   7. tiny Llama-family models (5 variants) vs transformers at 1e-4 in float32, on CUDA;
#   8. attention timing, Triton vs the torch SDPA backend (bench/attention_bench.py), bf16;
#   9. the served end-to-end tests on CUDA clusters (float32, CUDA graphs): greedy equals
#      transformers colocated and disaggregated, the OpenAI API, grammar-constrained requests, no
#      page leaks; minus the tests that need the real model's text (it counts, says "Paris",
#      closes a JSON object) and the JSONSchemaBench one (left out when it read ../shared's data;
#      its schemas are in tests/data now, untried on the GPU). Needs openai and jsonschema in .whl.
#
# Usage (repo root):  OUT=/some/dir bash bench/gpu_check.sh
# Results (five files: the device tool brings back at most eight): $OUT/summary.txt (one
# PASS/FAIL/SKIP line per step), $OUT/logs.txt (every step's output), $OUT/serving.json,
# $OUT/serving_eager.json (bench/serving.py results) and $OUT/attention_bench.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-540}))

step() {  # step NAME TIMEOUT_S CMD... : run, log to $LOGS/NAME.log and $OUT/logs.txt, record PASS/FAIL with seconds
  local name=$1 limit=$2 t0=$SECONDS rc left=$((DEADLINE - SECONDS))
  shift 2
  if [ "$left" -lt 20 ]; then
    echo "$name: SKIP (budget spent)" | tee -a "$SUMMARY"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit $limit s)"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  tail -n 30 "$LOGS/$name.log"
  { echo "=== $name"; cat "$LOGS/$name.log"; } >>"$OUT/logs.txt"
  local verdict=PASS
  [ "$rc" -ne 0 ] && verdict="FAIL (rc $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
  echo "$name: $verdict in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
}

# 1. The machine.
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'triton', triton.__version__)"
} 2>&1 | tee -a "$OUT/logs.txt"

# 2. Import path: the wheels, then the package shim.
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -n 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Links inside the tree's own splitserve/ (the device's throwaway copy; skipped where splitserve is
# installed): pytest and `python -m splitserve` put the repo root first on sys.path, so a shim
# folder elsewhere on PYTHONPATH would be shadowed by the repo's splitserve/.
if ! "$PY" -c "import splitserve.engine" 2>/dev/null; then
  for d in engine prefill decode kv_transfer radix_cache lang server; do
    [ -d "$d" ] && [ ! -e "splitserve/$d" ] && ln -s "../$d" "splitserve/$d"
  done
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import splitserve.engine.attention.triton.backend, splitserve.server.app; print('import ok')" \
  2>&1 | tee -a "$OUT/logs.txt"

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="" --durations=5)
export SPLITSERVE_DEVICE=${GPU_CHECK_DEVICE:-cuda}  # cpu: a dry run of the plumbing

# 3. Kernels and CUDA graphs on CUDA.
step kernels_and_graphs 150 "${PYTEST[@]}" tests/engine/test_cuda_graph.py \
  tests/engine/test_triton_attention.py
step quant_matmul 120 "${PYTEST[@]}" tests/engine/test_triton_quant_matmul.py

# 4. The SmolLM2-135M architecture with random weights, greedy vs transformers in float32.
export SPLITSERVE_CACHE=/tmp/splitserve-cache
MODEL=$SPLITSERVE_CACHE/SmolLM2-135M-Instruct
step random_smollm2 90 "$PY" - "$MODEL" <<'EOF'
import shutil, sys, pathlib, torch, transformers
dst = pathlib.Path(sys.argv[1])
src = pathlib.Path(".gpu_carry/SmolLM2-135M-Instruct")
if not (src / "config.json").exists():
    sys.exit(f"{src} missing: carry the default model's config and tokenizer (see the header)")
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    shutil.copy(f, dst / f.name)
torch.manual_seed(0)
cfg = transformers.AutoConfig.from_pretrained(dst)
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.save_pretrained(dst)
print("random-weight", cfg.model_type, sum(p.numel() for p in model.parameters()), "params at", dst)
EOF
step greedy_vs_hf_random_smollm2 150 "${PYTEST[@]}" tests/engine/test_default_model_vs_hf.py
step quant_decode_step 90 "$PY" bench/quant_decode_step.py --device cuda --model "$MODEL" \
  --batch 1 8 32 --steps 20 --configs none int8 int4

# 5./6. Serving on the GPU: transformers static batches vs our cluster, with and without graphs.
SERVING=(bench/serving.py --model "$MODEL" --dtype bfloat16 --dataset random --input-len 256
  --num-prompts 32 --output-len 32 --concurrency 1 32 --no-plots)
step serving_vs_transformers 200 "$PY" "${SERVING[@]}" --hf-static --launch colocated \
  --out "$LOGS/serving"
step serving_eager 120 "$PY" "${SERVING[@]}" --launch colocated --disable-cuda-graph \
  --out "$LOGS/serving_eager"
for d in serving serving_eager; do
  [ -f "$LOGS/$d/results.json" ] && cp "$LOGS/$d/results.json" "$OUT/$d.json"
done

# 7. Tiny models vs transformers, our model on CUDA with the automatically chosen Triton backend.
step tiny_models_vs_hf 120 "${PYTEST[@]}" tests/engine/test_model_vs_hf.py

# 8. Attention timing, Triton vs torch SDPA backend.
step attention_bench 90 "$PY" bench/attention_bench.py --out "$OUT/attention_bench.json"

# 9. Served end-to-end tests on CUDA (the clusters inherit SPLITSERVE_DEVICE).
step e2e_on_cuda 180 "${PYTEST[@]}" tests/e2e/test_greedy_vs_hf.py tests/e2e/test_openai_api.py \
  tests/e2e/test_grammar.py \
  -k "not jsonschemabench and not chat_non_streaming and not stop_string and not json_object"

echo "--- summary"
cat "$SUMMARY"
