#!/usr/bin/env bash
# llama.cpp's server as a peer: build it, convert our model to GGUF, serve it, measure it with
# bench/serving.py in the same run as splitserve. Documented in bench/README.md; not part of CI.
#
#   bash bench/peers/llamacpp.sh                 # build (once), convert (once), serve, measure
#   bash bench/peers/llamacpp.sh build           # only build llama-server
#   bash bench/peers/llamacpp.sh serve           # only serve (foreground) on $LLAMACPP_PORT
#   SERVING_ARGS="--concurrency 1 8 32 --num-prompts 64" bash bench/peers/llamacpp.sh
#
# Environment (all optional):
#   LLAMACPP_DIR      work folder (default ~/.cache/splitserve/llamacpp)
#   LLAMACPP_VERSION  llama-cpp-python sdist version whose vendored llama.cpp is built (0.3.36)
#   LLAMACPP_THREADS  server threads (default 2)      LLAMACPP_SLOTS  parallel slots (default 32)
#   LLAMACPP_CTX      context per slot (default 512)  LLAMACPP_PORT   server port (default 8090)
#   LLAMACPP_OUTTYPE  GGUF weight type: f16 (default), bf16 or f32
#   LLAMACPP_CACHE_PROMPT  1 keeps llama.cpp's prompt cache (off by default, see serve())
#   MODEL             HF model folder (default: splitserve's SmolLM2-135M-Instruct folder)
#   SERVING_ARGS      extra arguments for bench/serving.py
#   OUT               where results go (default bench/results/llamacpp-<date>)
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PY:-$REPO/.venv/bin/python}
VERSION=${LLAMACPP_VERSION:-0.3.36}
DIR=${LLAMACPP_DIR:-$HOME/.cache/splitserve/llamacpp}
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
BIN=$SRC/build/bin/llama-server
THREADS=${LLAMACPP_THREADS:-2}
SLOTS=${LLAMACPP_SLOTS:-32}
CTX=${LLAMACPP_CTX:-512}
PORT=${LLAMACPP_PORT:-8090}
OUTTYPE=${LLAMACPP_OUTTYPE:-f16}
OUT=${OUT:-$REPO/bench/results/llamacpp-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$DIR"

build() {
  if [ -x "$BIN" ]; then echo "llama-server already built: $BIN"; return; fi
  if [ ! -d "$SRC" ]; then
    ( cd "$DIR" && "$PY" -m pip download --no-deps --no-binary :all: \
        "llama-cpp-python==$VERSION" -d . && tar xzf "llama_cpp_python-$VERSION.tar.gz" )
  fi
  # CPU only, native ISA (AVX-512/AMX where present); no web UI download, no curl, no tests.
  cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
  time cmake --build "$SRC/build" --target llama-server llama-bench -j "$(nproc)"
}

model_dir() {
  if [ -n "${MODEL:-}" ]; then echo "$MODEL"; return; fi
  "$PY" -c "from splitserve.default_model import ensure_default_model as e; print(e())"
}

convert() {
  local model; model=$(model_dir)
  GGUF=$DIR/$(basename "$model")-$OUTTYPE.gguf
  if [ -f "$GGUF" ]; then echo "GGUF already converted: $GGUF"; return; fi
  # The converter imports sentencepiece before it looks for a tokenizer.model (then falls back to
  # tokenizer.json), so it needs the module even for BPE tokenizers such as SmolLM2's.
  "$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q sentencepiece
  "$PY" "$SRC/convert_hf_to_gguf.py" "$model" --outtype "$OUTTYPE" --outfile "$GGUF"
}

serve() {
  # One process, THREADS threads, SLOTS slots with continuous batching; ctx is the total.
  # Prompt caching off (per-slot reuse and the host-RAM cache): serving.py sends the same prompts
  # at every concurrency, so cached prompts would skip prefill from the second level on. Set
  # LLAMACPP_CACHE_PROMPT=1 to keep it (compare with a prefix-caching splitserve then).
  local cache=(--no-cache-prompt --cache-ram 0)
  if [ "${LLAMACPP_CACHE_PROMPT:-0}" = 1 ]; then cache=(); fi
  exec "$BIN" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -t "$THREADS" -tb "$THREADS" \
    -np "$SLOTS" -c $((SLOTS * CTX)) --cont-batching --no-webui "${cache[@]}"
}

wait_healthy() {
  for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    sleep 0.5
  done
  echo "llama-server did not become healthy" >&2; return 1
}

case "${1:-all}" in
  build) build ;;
  convert) build; convert ;;
  serve) build; convert; serve ;;
  all)
    build; convert
    mkdir -p "$OUT"
    uptime | tee "$OUT/uptime-before.txt"
    ( serve ) >"$OUT/llama-server.log" 2>&1 &
    SERVER_PID=$!
    trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
    wait_healthy
    # llama.cpp first, then our disaggregated cluster, same prompts, same client, one run.
    # shellcheck disable=SC2086
    "$PY" bench/serving.py --base-url "llama.cpp=http://127.0.0.1:$PORT" \
      --launch disaggregated --out "$OUT" ${SERVING_ARGS:-}
    uptime | tee "$OUT/uptime-after.txt"
    ;;
  *) echo "usage: $0 [all|build|convert|serve]" >&2; exit 2 ;;
esac
