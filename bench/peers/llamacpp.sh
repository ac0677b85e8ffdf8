#!/usr/bin/env bash
# llama.cpp as a peer: build it, convert our model to GGUF (F16, Q8_0, Q4_K_M, ...), serve each
# type and measure them with bench/serving.py in the same run as splitserve. Documented in
# bench/README.md; not part of CI. bench/quality.py --llamacpp and bench/prefill.py use the same
# build and GGUFs (llama-perplexity, llama-bench).
#
#   bash bench/peers/llamacpp.sh                 # build (once), convert (once), serve, measure
#   bash bench/peers/llamacpp.sh build           # only build the tools (missing targets only)
#   bash bench/peers/llamacpp.sh convert         # only make the GGUF(s); prints their paths
#   bash bench/peers/llamacpp.sh serve           # only serve the first type (foreground)
#   bash bench/peers/llamacpp.sh bindir          # where the tools are (builds nothing)
#   SERVING_ARGS="--concurrency 1 8 32 --num-prompts 64" bash bench/peers/llamacpp.sh
#   LLAMACPP_OUTTYPE="q8_0 q4_k_m" LAUNCH="colocated colocated:int8 colocated:int4" \
#     bash bench/peers/llamacpp.sh               # two GGUF servers and three splitserve clusters
#
# Environment (all optional):
#   LLAMACPP_DIR      work folder (default ~/.cache/splitserve/llamacpp)
#   LLAMACPP_VERSION  llama-cpp-python sdist version whose vendored llama.cpp is built (0.3.36)
#   LLAMACPP_NATIVE   1 (default): -march=native build in $SRC/build; 0: explicit AVX2 + AVX-512
#                     (F, VBMI, VNNI, BF16), no AMX, in $SRC/build-avx512 (see "Build flags")
#   LLAMACPP_THREADS  server threads (default 2)      LLAMACPP_SLOTS  parallel slots (default 32)
#   LLAMACPP_CTX      context per slot (default 512)  LLAMACPP_PORT   first server's port (8090)
#   LLAMACPP_OUTTYPE  GGUF weight type(s), space- or comma-separated (default f16): f16, bf16,
#                     f32 and q8_0 come from convert_hf_to_gguf.py; any other llama-quantize type
#                     (q4_k_m, q5_k_m, q4_0, ...) is quantized from the F16 GGUF. With several
#                     types, "all" starts one server per type on consecutive ports, all measured
#                     in one serving.py run (an idle llama-server takes no CPU time).
#   LLAMACPP_CACHE_PROMPT  1 keeps llama.cpp's prompt cache (off by default, see serve())
#   LAUNCH            splitserve clusters serving.py starts after the llama.cpp targets,
#                     space-separated --launch values (default "disaggregated"; "" for none)
#   MODEL             HF model folder (default: splitserve's SmolLM2-135M-Instruct folder)
#   SERVING_ARGS      extra arguments for bench/serving.py
#   OUT               where results go (default bench/results/llamacpp-<date>)
#
# Build flags: GGML_NATIVE=ON compiles for the build machine's ISA (-march=native), binaries are
# per machine: a build folder carried to another CPU can die with "Illegal instruction"
# (`rm -rf $SRC/build` rebuilds for the CPU at hand). Quantized weights take paths F16 never
# does: ggml's repacked layouts (ggml-cpu/repack.cpp) and, where -march=native finds AMX, its
# AMX kernels (ggml-cpu/amx: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS). On the Intel (AMX) VM
# of 2026-12-02 the Q8_0 GGUF died with "Illegal instruction" while F16 ran; which of the two
# raised it was not found (no AMX machine since). On AMD Zen 5 (AVX-512, no AMX) the native
# build serves Q8_0 and Q4_K_M (docs/performance.md). If an AMX machine shows it again, try
# LLAMACPP_NATIVE=0 (no AMX) and, if it still dies, `gdb -batch -ex run -ex "x/i \$pc" --args
# $BIN/llama-bench -m Q8_0.gguf -p 64 -n 8` names the instruction.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PY:-$REPO/.venv/bin/python}
VERSION=${LLAMACPP_VERSION:-0.3.36}
DIR=${LLAMACPP_DIR:-$HOME/.cache/splitserve/llamacpp}
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ "${LLAMACPP_NATIVE:-1}" = 1 ]; then
  BUILD=$SRC/build ISA=(-DGGML_NATIVE=ON)
else
  BUILD=$SRC/build-avx512
  ISA=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
       -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
       -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
BIN=$BUILD/bin
THREADS=${LLAMACPP_THREADS:-2}
SLOTS=${LLAMACPP_SLOTS:-32}
CTX=${LLAMACPP_CTX:-512}
PORT=${LLAMACPP_PORT:-8090}
read -r -a OUTTYPES <<<"$(echo "${LLAMACPP_OUTTYPE:-f16}" | tr ',' ' ' | tr '[:upper:]' '[:lower:]')"
read -r -a LAUNCHES <<<"${LAUNCH-disaggregated}"
TARGETS=(llama-server llama-bench llama-quantize llama-perplexity)
OUT=${OUT:-$REPO/bench/results/llamacpp-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$DIR"

build() {
  local missing=()
  for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || missing+=("$t"); done
  if [ ${#missing[@]} = 0 ]; then echo "llama.cpp tools already built in $BIN"; return; fi
  if [ ! -d "$SRC" ]; then
    ( cd "$DIR" && "$PY" -m pip download --no-deps --no-binary :all: \
        "llama-cpp-python==$VERSION" -d . && tar xzf "llama_cpp_python-$VERSION.tar.gz" )
  fi
  # CPU only, ISA as above; no web UI download, no curl, no tests.
  # LLAMA_BUILD_TOOLS (default ON) is what defines llama-quantize and llama-perplexity.
  if [ ! -f "$BUILD/build.ninja" ]; then
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_TOOLS=ON
  fi
  # Only the missing targets: the libraries they share with a finished build are up to date.
  time cmake --build "$BUILD" --target "${missing[@]}" -j "$(nproc)"
}

model_dir() {
  if [ -n "${MODEL:-}" ]; then echo "$MODEL"; return; fi
  "$PY" -c "from splitserve.default_model import ensure_default_model as e; print(e())"
}

gguf_path() {  # gguf_path TYPE: where the GGUF of that weight type is (or will be)
  local model; model=$(model_dir)
  echo "$DIR/$(basename "$model")-$1.gguf"
}

convert() {  # convert TYPE: make that GGUF once
  local type=$1 model out; model=$(model_dir); out=$(gguf_path "$type")
  if [ -f "$out" ]; then echo "GGUF already converted: $out"; return; fi
  case "$type" in
    f16|bf16|f32|q8_0)
      # The converter imports sentencepiece before it looks for a tokenizer.model (then falls
      # back to tokenizer.json), so it needs the module even for BPE tokenizers (SmolLM2's).
      "$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q sentencepiece
      "$PY" "$SRC/convert_hf_to_gguf.py" "$model" --outtype "$type" --outfile "$out.part"
      ;;
    *)
      # k-quants and the rest: llama-quantize from the F16 GGUF (it refuses a type it lacks).
      convert f16
      "$BIN/llama-quantize" "$(gguf_path f16)" "$out.part" "$type" "$THREADS"
      ;;
  esac
  mv "$out.part" "$out"  # a killed conversion leaves no file that looks finished
}

serve() {  # serve TYPE PORT (foreground)
  # One process, THREADS threads, SLOTS slots with continuous batching; ctx is the total.
  # Prompt caching off (per-slot reuse and the host-RAM cache): serving.py sends the same prompts
  # at every concurrency, so cached prompts would skip prefill from the second level on. Set
  # LLAMACPP_CACHE_PROMPT=1 to keep it (compare with a prefix-caching splitserve then).
  local cache=(--no-cache-prompt --cache-ram 0)
  if [ "${LLAMACPP_CACHE_PROMPT:-0}" = 1 ]; then cache=(); fi
  exec "$BIN/llama-server" -m "$(gguf_path "$1")" --host 127.0.0.1 --port "$2" -t "$THREADS" \
    -tb "$THREADS" -np "$SLOTS" -c $((SLOTS * CTX)) --cont-batching --no-webui "${cache[@]}"
}

wait_healthy() {  # wait_healthy PORT PID
  for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null; then return 0; fi
    if ! kill -0 "$2" 2>/dev/null; then
      echo "llama-server on port $1 exited (see its log under $OUT)" >&2; return 1
    fi
    sleep 0.5
  done
  echo "llama-server on port $1 did not become healthy" >&2; return 1
}

convert_all() { for t in "${OUTTYPES[@]}"; do convert "$t"; done; }

case "${1:-all}" in
  bindir) echo "$BIN" ;;
  build) build ;;
  convert)  # the build and conversion logs on stderr, then one GGUF path per type on stdout
    { build; convert_all; } >&2
    for t in "${OUTTYPES[@]}"; do gguf_path "$t"; done ;;
  serve) build; convert "${OUTTYPES[0]}"; serve "${OUTTYPES[0]}" "$PORT" ;;
  all)
    build; convert_all
    mkdir -p "$OUT"
    uptime | tee "$OUT/uptime-before.txt"
    PIDS=() URLS=()
    trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
    for i in "${!OUTTYPES[@]}"; do
      t=${OUTTYPES[$i]} port=$((PORT + i))
      ( serve "$t" "$port" ) >"$OUT/llama-server-$t.log" 2>&1 &
      PIDS+=($!)
      wait_healthy "$port" "${PIDS[-1]}"
      URLS+=(--base-url "llama.cpp $(echo "$t" | tr '[:lower:]' '[:upper:]')=http://127.0.0.1:$port")
    done
    LAUNCH_ARGS=()
    for m in "${LAUNCHES[@]}"; do LAUNCH_ARGS+=(--launch "$m"); done
    # llama.cpp first, then our clusters, same prompts, same client, one run.
    # shellcheck disable=SC2086
    "$PY" bench/serving.py "${URLS[@]}" "${LAUNCH_ARGS[@]}" --out "$OUT" ${SERVING_ARGS:-}
    uptime | tee "$OUT/uptime-after.txt"
    ;;
  *) echo "usage: $0 [all|build|convert|serve|bindir]" >&2; exit 2 ;;
esac
