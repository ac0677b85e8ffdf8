#!/usr/bin/env bash
# Install, then run the whole test suite (unit, engine vs transformers, launched clusters).
# The optional extras whose tests exist are installed too, so this and CI run the same tests:
# SPLITSERVE_EXTRAS (default mooncake,nixl,ray,tool-model; set it empty to install none, their tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITSERVE_EXTRAS=${SPLITSERVE_EXTRAS-mooncake,nixl,ray,tool-model} bash scripts/install.sh
. .venv/bin/activate
# The machine, first: which kernel tests run or skip, and every timing, depend on it.
echo "CPU: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')" \
  "(family $(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')," \
  "model $(grep -m1 '^model[[:space:]]*:' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')), $(nproc) cores;" \
  "$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|avx512_vnni|amx_tile)$' | tr '\n' ' ')"
# --durations: the slowest tests, so the suite's time on a 2-core machine stays visible.
exec python -m pytest -q --durations=25 "$@"
