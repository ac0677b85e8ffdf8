"""OpenVINO GenAI's ``ContinuousBatchingPipeline`` on bench/serving.py's prompts, in process.

Runs in the OpenVINO venv that ``bench/peers/openvino.sh`` makes (it imports only
``openvino_genai``, ``openvino`` and numpy, never splitserve or torch). bench/ov_peer.py starts it
as a subprocess with a JSON job on stdin and reads a JSON result from stdout:

    job:    {"model_dir": str, "prompts": [[token ids]], "output_len": int,
             "concurrency": [int], "threads": int, "max_num_seqs": int, "cache_size_gb": int,
             "kv_cache_precision": str | null}
    result: {"versions": {...}, "runs": [{"concurrency": c, "wall": s,
             "records": [{"start", "ttft", "latency", "itls", "prompt_len", "output_tokens"}]}]}

Each concurrency level is a closed loop like serving.py's: ``c`` requests in flight, a new one
added as soon as one finishes, greedy, exactly ``output_len`` new tokens (``ignore_eos``). The
pipeline is driven by its own ``step()`` (what its ``generate`` does inside); each request's
streamed tokens are read after every step, so TTFT and the gaps between tokens are measured the
way a streaming client sees them, minus HTTP. One pipeline serves every level (``max_num_seqs``
slots, like a server started once). Reference: openvino_genai's ContinuousBatchingPipeline,
SchedulerConfig and GenerationHandle (OpenVINO GenAI 2026.4 Python API).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any


def run_level(pipe: Any, prompts: list[list[int]], output_len: int, c: int, first_id: int) -> dict:
    """One closed-loop level: every prompt through ``pipe`` with ``c`` in flight.

    Returns ``{"concurrency", "wall" (s), "records"}``; a record's times are seconds, ``start``
    since the level's start, ``itls`` one gap per streamed chunk after the first.
    """
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai
    from openvino_genai.py_openvino_genai import GenerationStatus

    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = output_len
    cfg.min_new_tokens = output_len
    cfg.ignore_eos = True
    cfg.do_sample = False
    pending = list(enumerate(prompts))
    pending.reverse()
    inflight: dict[int, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []
    t_run = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < c:
            i, ids = pending.pop()
            t0 = time.perf_counter()
            handle = pipe.add_request(
                first_id + i, ov.Tensor(np.asarray([ids], dtype=np.int64)), cfg
            )
            inflight[i] = {"handle": handle, "t0": t0, "stamps": [], "n": 0, "len": len(ids)}
        pipe.step()
        now = time.perf_counter()
        for i in list(inflight):
            r = inflight[i]
            handle = r["handle"]
            if handle.can_read():
                new = sum(len(o.generated_ids) for o in handle.read().values())
                if new:
                    r["n"] += new
                    r["stamps"].append(now)
            if handle.get_status() != GenerationStatus.RUNNING:
                stamps = r["stamps"] or [now]
                records.append(
                    {
                        "start": r["t0"] - t_run,
                        "ttft": stamps[0] - r["t0"],
                        "latency": stamps[-1] - r["t0"],
                        "itls": [b - a for a, b in itertools.pairwise(stamps)],
                        "prompt_len": r["len"],
                        "output_tokens": r["n"],
                    }
                )
                del inflight[i]
    return {"concurrency": c, "wall": time.perf_counter() - t_run, "records": records}


def main() -> int:
    """Read the job from stdin, run every level, print the result on stdout."""
    import openvino as ov
    import openvino_genai as ov_genai

    job = json.load(sys.stdin)
    sched = ov_genai.SchedulerConfig()
    sched.max_num_seqs = job["max_num_seqs"]
    sched.cache_size = job["cache_size_gb"]
    # Off like llama.cpp's prompt cache: every level re-sends the same prompts (serving.py flushes
    # splitserve's prefix cache before each level).
    sched.enable_prefix_caching = False
    props: dict[str, Any] = {"INFERENCE_NUM_THREADS": job["threads"]}
    if job.get("kv_cache_precision"):
        props["KV_CACHE_PRECISION"] = job["kv_cache_precision"]
    pipe = ov_genai.ContinuousBatchingPipeline(job["model_dir"], sched, "CPU", props)
    prompts, output_len = job["prompts"], job["output_len"]
    run_level(pipe, prompts[:2], min(8, output_len), 2, 10**6)  # warm-up
    runs = []
    for k, c in enumerate(job["concurrency"]):
        runs.append(run_level(pipe, prompts, output_len, c, (k + 1) * 10**7))
        print(f"openvino c={c}: {runs[-1]['wall']:.1f} s", file=sys.stderr, flush=True)
    versions = {
        "openvino": ov.get_version(),
        "openvino_genai": ov_genai.__version__,
        "scheduler": sched.to_string().strip(),
        "properties": props,
    }
    json.dump({"versions": versions, "runs": runs}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
