"""What a worker's weights take in memory on CPU, per ``--quantization``.

Loads the model as a worker does (``engine.model.loader.load_model``: bfloat16, packed for
oneDNN and the C kernels unless ``SPLITSERVE_PACK_WEIGHTS=0``) once per scheme, each in a
fresh process so one load's heap does not count in the next, and prints per scheme the
process's resident set after the load, its peak during the load and the model's own count
(``DecoderLM.weight_bytes``: parameters plus packed copies, what ``GET /workers`` reports as
``weight_bytes``), in MiB. The CPU is printed first.

    .venv/bin/python bench/weight_memory.py --model ~/.cache/splitserve/Qwen2.5-Coder-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import gc
import resource
import subprocess
import sys

from common import cpu_line


def resident_mb() -> float:
    """This process's resident set (``VmRSS``), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(model_path: str, quantization: str) -> str:
    """Load ``model_path`` under ``quantization`` in this process; one line of figures."""
    import torch

    from splitserve.config import EngineConfig
    from splitserve.engine.model.loader import load_model

    before = resident_mb()
    model, _ = load_model(model_path, dtype=torch.bfloat16,
                          engine=EngineConfig(quantization=quantization))
    gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (f"{quantization:5s} resident {resident_mb():7.0f} MiB (before the load "
            f"{before:.0f}, peak {peak:.0f})  weight_bytes {model.weight_bytes() / 2**20:7.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model folder or .gguf file")
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: one scheme
    args = parser.parse_args()
    if args.one:
        print(measure(args.model, args.one), flush=True)
        return
    print(cpu_line())
    print(f"model {args.model}")
    for scheme in args.quantization:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--one", scheme],
                             capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
