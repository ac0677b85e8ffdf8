#!/usr/bin/env bash
# Install, then start 1 prefill + 1 decode worker on the default model, send real chat and
# completion requests through the openai client, print answers and TTFT, and stop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec splitserve demo "$@"
