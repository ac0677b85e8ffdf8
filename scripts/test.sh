#!/usr/bin/env bash
# Install, then run the whole test suite (unit, engine vs transformers, launched clusters).
# The optional extras whose tests exist are installed too, so this and CI run the same tests:
# SPLITSERVE_EXTRAS (default mooncake,nixl,ray,tool-model; set it empty to install none, their tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
SPLITSERVE_EXTRAS=${SPLITSERVE_EXTRAS-mooncake,nixl,ray,tool-model} bash scripts/install.sh
. .venv/bin/activate
# The machine, first: which kernel tests run or skip, and every timing, depend on it.
python -c 'from splitserve.engine.kernels.cpu.features import cpu_line; print("CPU:", cpu_line())' || true
# --durations: the slowest tests, so the suite's time on a 2-core machine stays visible.
exec python -m pytest -q --durations=25 "$@"
