#!/usr/bin/env bash
# Install, then run the whole test suite (unit, engine vs transformers, launched clusters).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
