"""The command line of bench/serving.py: its targets (servers, launched clusters, the in-process
baselines), how launched clusters run, the dataset, the load levels, the SLOs and where results
go, with the checks between them. serving.py's ``parse_args`` calls this one with its own
description.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import add_data_argument
from serving_metrics import SLO_KINDS


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """``argv`` (None: ``sys.argv[1:]``) as serving.py's arguments; exits with a usage error
    (``SystemExit``) when they name no target or ask a baseline for what it cannot run.
    ``description`` heads ``--help``."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    t = p.add_argument_group("targets (in the order given; ratios are against the first)")
    t.add_argument("--base-url", action="append", default=[], metavar="[NAME=]URL")
    t.add_argument(
        "--launch",
        action="append",
        default=[],
        choices=[
            f"{m}{q}{kv}{s}{split}"
            for m in ("disaggregated", "colocated")
            for q in ("", ":int8", ":int4")
            for kv in ("", ":kv8")
            for s in ("", ":ngram")
            for split in ("", ":split")
        ],
        help="start a local splitserve cluster (MODE:int8, MODE:int4: with --quantization; "
        "...:kv8: with --kv-cache-dtype int8; ...:ngram: with --speculative ngram; ...:split: "
        "with --no-share-cores)",
    )
    t.add_argument(
        "--hf-static",
        action="store_true",
        help="first, transformers generate on static batches (batch = concurrency level) in "
        "this process (bench/hf_static.py): the in-process baseline",
    )
    t.add_argument(
        "--openvino",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="OpenVINO GenAI ContinuousBatchingPipeline on this exported model folder, in process "
        "under --openvino-python (bench/ov_peer.py, bench/peers/openvino.sh), after --hf-static",
    )
    t.add_argument(
        "--openvino-python",
        default=None,
        help="python of the OpenVINO venv (default: bench/peers/openvino.sh's, "
        "$SPLITSERVE_CACHE/openvino/venv/bin/python)",
    )
    t.add_argument(
        "--openvino-threads", type=int, default=0, help="INFERENCE_NUM_THREADS (default: all)"
    )
    t.add_argument(
        "--openvino-kv-precision",
        default=None,
        help="KV_CACHE_PRECISION, e.g. u8 or bf16 (default: OpenVINO's own choice, u8 on CPU)",
    )
    t.add_argument("--hf-device", default=None, help="--hf-static device (default: cuda if any)")
    t.add_argument(
        "--hf-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="--hf-static batch sizes (default: the --concurrency levels); e.g. only 32, as "
        "batch 1 of 64 prompts x 128 tokens takes minutes on CPU",
    )
    t.add_argument(
        "--served-model",
        default=None,
        help="the request's model field (default: the first of /v1/models)",
    )
    t.add_argument(
        "--keep-cache",
        dest="flush_cache",
        action="store_false",
        help="do not POST /flush_cache before each load level (same prompts at every level)",
    )
    t.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (servers that reject unknown fields)",
    )
    c = p.add_argument_group("launched clusters")
    c.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    c.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    c.add_argument("--threads-per-worker", type=int, default=0)
    c.add_argument(
        "--cpu-affinity",
        default=None,
        help="pin workers, e.g. 'prefill=0 decode=1' or 'colocated=0,1'",
    )
    c.add_argument("--max-running", type=int, default=64)
    c.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="drafts per step of :ngram launches"
    )
    c.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="launched CUDA workers (--device cuda or $SPLITSERVE_DEVICE) decode eagerly",
    )
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    add_data_argument(d)
    d.add_argument("--num-prompts", type=int, default=64)
    d.add_argument("--max-input-len", type=int, default=256, help="sharegpt: truncate to this")
    d.add_argument("--input-len", type=int, default=512, help="random: prompt tokens")
    d.add_argument("--output-len", type=int, default=128)
    d.add_argument("--tokenizer", default=None, help="default: the --model folder")
    d.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="send token ids (same tokens everywhere) or decoded text",
    )
    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ld.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=None,
        help="Poisson arrivals per second (inf: all at once); overrides --concurrency",
    )
    ld.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate")
    ld.add_argument(
        "--slo",
        nargs="*",
        default=[],
        metavar="KIND:MS",
        help=f"goodput SLOs, KIND in {SLO_KINDS} (itl: a request's largest gap)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help="folder for results.json and PNGs")
    o.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if not args.base_url and not args.launch and not args.hf_static and not args.openvino:
        p.error("give at least one --base-url, --launch, --hf-static or --openvino")
    if args.openvino and (args.request_rate or args.prompt_format != "ids"):
        p.error("--openvino runs closed loops: use --concurrency and --prompt-format ids")
    if args.hf_static and (args.request_rate or args.prompt_format != "ids"):
        p.error("--hf-static runs static batches: use --concurrency and --prompt-format ids")
    return args
