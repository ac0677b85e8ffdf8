#!/usr/bin/env bash
# OpenVINO GenAI as a peer: a venv of its own (never splitserve's), our model exported with
# optimum-cli (fp16, int8, int4 weights), and its ContinuousBatchingPipeline measured in process
# by bench/serving.py --openvino on the same prompts and lengths, in the same run as splitserve.
# Documented in bench/README.md; not part of CI.
#
#   bash bench/peers/openvino.sh                 # set up (once), export (once), measure
#   bash bench/peers/openvino.sh setup           # only the venv
#   bash bench/peers/openvino.sh export          # only the exported folders; prints their paths
#   bash bench/peers/openvino.sh python          # the venv's python (sets up nothing)
#   OV_WEIGHTS="fp16 int8" LAUNCH="colocated colocated:int8" SERVING_ARGS="--concurrency 1 32" \
#     bash bench/peers/openvino.sh
#
# Environment (all optional):
#   OV_DIR        work folder (default $SPLITSERVE_CACHE/openvino, i.e. ~/.cache/splitserve/openvino)
#   OV_VERSION    openvino-genai version (default 2026.4.1.0); optimum-intel OPTIMUM_INTEL_VERSION
#                 (default 2.2.0)
#   OV_WEIGHTS    weight format(s) for `optimum-cli export openvino --weight-format`, space- or
#                 comma-separated (default "fp16 int8"; also int4)
#   OV_THREADS    INFERENCE_NUM_THREADS (default: all cores, like the launched clusters)
#   OV_KV         KV_CACHE_PRECISION (default: OpenVINO's, u8 on CPU)
#   LAUNCH        splitserve clusters measured after OpenVINO (default "colocated"; "" for none)
#   MODEL         HF model folder (default: splitserve's SmolLM2-135M-Instruct folder)
#   SERVING_ARGS  extra arguments for bench/serving.py
#   OUT           where results go (default bench/results/openvino-<date>)
#
# HTTP: neither openvino-genai nor OpenVINO Model Server ships an OpenAI-compatible server on PyPI
# (OVMS is a binary/Docker release), so OpenVINO is measured in process, without HTTP, while the
# splitserve clusters pay for HTTP: the comparison favours OpenVINO.
#
# torch: optimum-intel's exporter traces the model with torch. The venv pins torch==2.13.0 (the
# project's CPU build) through a constraints file so pip never swaps in another torch.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PY:-$REPO/.venv/bin/python}
DIR=${OV_DIR:-${SPLITSERVE_CACHE:-$HOME/.cache/splitserve}/openvino}
VENV=$DIR/venv
OVPY=$VENV/bin/python
OV_VERSION=${OV_VERSION:-2026.4.1.0}
OPTIMUM_INTEL_VERSION=${OPTIMUM_INTEL_VERSION:-2.2.0}
read -r -a WEIGHTS <<<"$(echo "${OV_WEIGHTS:-fp16 int8}" | tr ',' ' ' | tr '[:upper:]' '[:lower:]')"
read -r -a LAUNCHES <<<"${LAUNCH-colocated}"
OUT=${OUT:-$REPO/bench/results/openvino-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$DIR"

setup() {
  if "$OVPY" -c "import openvino_genai, optimum.intel" 2>/dev/null; then
    echo "OpenVINO venv ready: $VENV"; return
  fi
  [ -x "$OVPY" ] || python3 -m venv "$VENV"
  echo "torch==2.13.0" >"$DIR/constraints.txt"
  "$OVPY" -m pip install -q -c "$DIR/constraints.txt" "torch==2.13.0" \
    "openvino-genai==$OV_VERSION" "optimum-intel[openvino]==$OPTIMUM_INTEL_VERSION"
  "$OVPY" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  # optimum-intel asks for torchvision (for vision models only); pip picks one built for another
  # torch ("operator torchvision::nms does not exist" breaks `import transformers`): remove it.
  if ! "$OVPY" -c "import torchvision" 2>/dev/null; then
    "$OVPY" -m pip uninstall -y -q torchvision
  fi
}

model_dir() {
  if [ -n "${MODEL:-}" ]; then echo "$MODEL"; return; fi
  "$PY" -c "from splitserve.default_model import ensure_default_model as e; print(e())"
}

export_path() {  # export_path FORMAT: where that export is (or will be)
  echo "$DIR/$(basename "$(model_dir)")-ov-$1"
}

export_one() {  # export_one FORMAT: optimum-cli export once (fp16: no compression)
  local fmt=$1 out; out=$(export_path "$fmt")
  if [ -f "$out/openvino_model.xml" ]; then echo "already exported: $out"; return; fi
  rm -rf "$out.part"
  "$VENV/bin/optimum-cli" export openvino --model "$(model_dir)" --task text-generation-with-past \
    --weight-format "$fmt" "$out.part"
  mv "$out.part" "$out"  # a killed export leaves no folder that looks finished
}

export_all() { for f in "${WEIGHTS[@]}"; do export_one "$f"; done; }

case "${1:-all}" in
  python) echo "$OVPY" ;;
  setup) setup ;;
  export)  # the logs on stderr, then one folder per format on stdout
    { setup; export_all; } >&2
    for f in "${WEIGHTS[@]}"; do export_path "$f"; done ;;
  all)
    setup; export_all
    mkdir -p "$OUT"
    { grep -m1 "model name" /proc/cpuinfo; uptime; } | tee "$OUT/uptime-before.txt"
    OV_ARGS=()
    for f in "${WEIGHTS[@]}"; do OV_ARGS+=(--openvino "OpenVINO GenAI $f=$(export_path "$f")"); done
    LAUNCH_ARGS=()
    for m in "${LAUNCHES[@]}"; do LAUNCH_ARGS+=(--launch "$m"); done
    OPT=(--openvino-python "$OVPY")
    [ -n "${OV_THREADS:-}" ] && OPT+=(--openvino-threads "$OV_THREADS")
    [ -n "${OV_KV:-}" ] && OPT+=(--openvino-kv-precision "$OV_KV")
    # OpenVINO first (in process), then our clusters over HTTP, same prompts, one run.
    # shellcheck disable=SC2086
    "$PY" bench/serving.py "${OV_ARGS[@]}" "${OPT[@]}" "${LAUNCH_ARGS[@]}" --out "$OUT" \
      ${SERVING_ARGS:-}
    uptime | tee "$OUT/uptime-after.txt"
    ;;
  *) echo "usage: $0 [all|setup|export|python]" >&2; exit 2 ;;
esac
