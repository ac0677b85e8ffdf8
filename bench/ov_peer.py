"""OpenVINO GenAI as an in-process peer of bench/serving.py (``--openvino [NAME=]DIR``).

OpenVINO lives in its own venv (``bench/peers/openvino.sh`` makes it, with the exported models),
never in splitserve's: this module hands the run's prompts to ``bench/ov_pipeline.py`` under that
venv's python (``--openvino-python``) and turns what it measured into serving.py runs, the same
metrics as a served target (TTFT, ITL, TPOT, throughput), minus HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from serving_metrics import RequestOutput, print_summary, summarize

HERE = Path(__file__).resolve().parent


def parse_spec(spec: str) -> tuple[str, str]:
    """``"NAME=DIR"`` or ``"DIR"`` -> ``(name, dir)``; the name defaults to the folder's name."""
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = f"openvino {Path(spec).name}", spec
    return name, path


def run_openvino(works: list[Any], args: Any) -> list[dict[str, Any]]:
    """One ``ContinuousBatchingPipeline`` per ``--openvino`` model folder, every concurrency level.

    Raises:
        RuntimeError: the OpenVINO subprocess failed (its stderr is shown above).
    """
    runs: list[dict[str, Any]] = []
    for spec in args.openvino:
        name, model_dir = parse_spec(spec)
        job = {
            "model_dir": model_dir,
            "prompts": [w.prompt for w in works],
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "threads": args.openvino_threads or os.cpu_count(),
            "max_num_seqs": max(args.concurrency),
            "cache_size_gb": 1,
            "kv_cache_precision": args.openvino_kv_precision,
        }
        print(f"{name}: ContinuousBatchingPipeline({model_dir})", flush=True)
        proc = subprocess.run(
            [args.openvino_python, str(HERE / "ov_pipeline.py")],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            check=False,
        )
        sys.stderr.write(proc.stderr[-4000:])
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: ov_pipeline.py exited with {proc.returncode}")
        result = json.loads(proc.stdout)
        print(f"{name}: {result['versions']}", flush=True)
        for level in result["runs"]:
            outs = [RequestOutput(tag="", **r) for r in level["records"]]
            s = summarize(outs, level["wall"], {})
            c = level["concurrency"]
            print_summary(name, f"c={c}", s)
            runs.append(
                {"target": name, "url": "", "load": f"c={c}", "load_kind": "concurrency",
                 "load_value": c, "summary": s,
                 "raw": {"ttft": [o.ttft for o in outs], "e2e": [o.latency for o in outs],
                         "itl": [x for o in outs for x in o.itls],
                         "tpot": [o.tpot for o in outs]}}
            )  # fmt: skip
    return runs
