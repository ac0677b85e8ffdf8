"""What the benchmarks share: prompts (ShareGPT, random), percentiles, the model and dtype
defaults, an in-process engine, and starting a local splitserve cluster.

The scripts in ``bench/`` run as files (``python bench/serving.py``), so their folder is on
``sys.path`` and they import this module as ``common``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitserve.engine.kernels.cpu.features import cpu_line
from splitserve.ipc.sockets import free_tcp_addr

if TYPE_CHECKING:  # the engine (torch) is imported only by the benchmarks that run it
    import torch

    from splitserve.config import EngineConfig
    from splitserve.engine.core import EngineCore
    from splitserve.engine.kv_pool import KVPool

# The repository's copy of the data sets (samples of the large ones: tests/data/MANIFEST.json).
# ``--data DIR`` points a benchmark at another folder laid out the same way, e.g. the full sets.
DATA_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"
SHAREGPT = Path("prompts") / "sharegpt"  # under a data folder: ShareGPT ``*.jsonl``
MAX_PROMPT_TOKENS = 256
SEED = 0


def resolve_bench_dtype(name: str) -> tuple[str, str]:
    """``--dtype`` as ``splitserve serve`` resolves it, and why: ``auto`` is bfloat16 with
    AMX/avx512_bf16, or with AVX2 where the C kernels build (so they are built first)."""
    from splitserve.engine.kernels.cpu.build import load_cpu_kernels
    from splitserve.engine.kernels.cpu.features import resolve_dtype

    return resolve_dtype(name, c_kernels=name == "auto" and load_cpu_kernels() is not None)


def default_dtype() -> tuple[str, str]:
    """The default serving dtype on this machine and why (:func:`resolve_bench_dtype`)."""
    return resolve_bench_dtype("auto")


def resolve_model(model: str | None) -> str:
    """``--model`` or the default model's safetensors folder."""
    if model:
        return model
    from splitserve.default_model import ensure_default_model

    return str(ensure_default_model())


def make_core(
    model: torch.nn.Module, pool: KVPool, eos_token_ids: list[int],
    engine: EngineConfig | None = None, **runner: Any,
) -> EngineCore:
    """An in-process engine (no worker, no sockets, no prefix cache) over ``pool``: a scheduler
    reading ``engine``'s budgets and a :class:`ModelRunner` of ``model`` (``runner``: its
    keywords)."""
    from splitserve.config import EngineConfig
    from splitserve.engine.core import EngineCore
    from splitserve.engine.runner.model_runner import ModelRunner
    from splitserve.engine.sched.scheduler import Scheduler
    from splitserve.radix_cache.prefix_cache import create_prefix_cache

    cache = create_prefix_cache("none", pool.allocator, pool.page_size)
    scheduler = Scheduler(cache, engine or EngineConfig(), eos_token_ids)
    runner = {"eos_token_ids": eos_token_ids, **runner}  # min_tokens masks them
    return EngineCore(scheduler, ModelRunner(model, pool, **runner))


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """``--data DIR``: the data folder a benchmark reads its data set from (default
    ``tests/data``; a folder of the full sets, laid out like it, gives more prompts)."""
    parser.add_argument("--data", type=Path, default=DATA_DIR,
                        help="data folder laid out like tests/data (default: tests/data, "
                        "which holds samples of the large sets)")


def first_user_turns(folder: Path) -> list[str]:
    """The first human turn of every ShareGPT conversation under ``folder`` (``*.jsonl``)."""
    texts: list[str] = []
    for path in sorted(folder.glob("*.jsonl")):
        with path.open() as f:
            for line in f:
                if not line.strip():
                    continue
                conv = json.loads(line).get("conversations", [])
                turn = next((t for t in conv if t.get("from") in ("human", "user")), None)
                if turn and turn.get("value", "").strip():
                    texts.append(turn["value"])
    return texts


def load_prompts(
    tokenizer: Any, num: int, max_tokens: int = MAX_PROMPT_TOKENS, min_tokens: int = 1,
    data: Path = DATA_DIR,
) -> list[list[int]]:
    """``num`` ShareGPT first user turns as token ids, each truncated to ``max_tokens``, from
    ``data/prompts/sharegpt/*.jsonl``.

    The selection is a seeded shuffle, so every run (and every system) sees the same prompts.

    Raises:
        SystemExit: if the folder holds fewer than ``num`` usable prompts.
    """
    folder = data / SHAREGPT
    texts = first_user_turns(folder)
    if not texts:
        raise SystemExit(f"no ShareGPT prompts found under {folder}")
    random.Random(SEED).shuffle(texts)
    prompts: list[list[int]] = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=True)[:max_tokens]
        if len(ids) >= min_tokens:
            prompts.append(ids)
        if len(prompts) == num:
            break
    if len(prompts) < num:
        raise SystemExit(f"only {len(prompts)} usable prompts under {folder}, {num} requested "
                         "(--data DIR: a folder with more)")
    return prompts


def random_prompts(tokenizer: Any, num: int, input_len: int, seed: int = SEED) -> list[list[int]]:
    """``num`` prompts of exactly ``input_len`` random ordinary token ids (no special tokens)."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(num)]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def write_results(path: Path, args: argparse.Namespace, results: Any) -> None:
    """Write ``{"cpu", "config", "results"}`` as JSON to ``path`` (its folder made): the CPU
    line, the run's arguments (paths as strings) and what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"cpu": cpu_line(), "config": config, "results": results},
                               indent=2))


def launch_fields(value: str, num_speculative_tokens: int) -> tuple[str, str, dict[str, Any]]:
    """``MODE[:int8|:int4][:kv8][:ngram][:split]`` -> ``(mode, target name, config fields)``:
    the weights' ``quantization``; with ``:kv8``, the KV cache in int8 (``kv_cache_dtype``, as
    OpenVINO keeps it on the CPU by default); with ``:ngram``, n-gram speculative decoding of
    ``num_speculative_tokens`` drafts; with ``:split``, no core share (``share_cores`` off,
    ``--no-share-cores``: each worker keeps its split of the cores).

    Raises:
        ValueError: an option other than those.
    """
    mode, *options = value.split(":")
    unknown = set(options) - {"int8", "int4", "kv8", "ngram", "split"}
    if unknown:
        raise ValueError(f"--launch {value}: unknown option(s) {sorted(unknown)}")
    fields: dict[str, Any] = {
        "quantization": next((o for o in options if o in ("int8", "int4")), "none")
    }
    if "kv8" in options:
        fields["kv_cache_dtype"] = "int8"
    if "split" in options:
        fields["share_cores"] = False
    if "ngram" in options:
        fields["speculative"] = "ngram"
        fields["num_speculative_tokens"] = num_speculative_tokens
    return mode, " ".join(["splitserve", mode, *options]), fields


@contextmanager
def launch_cluster(mode: str, model_path: str, dtype: str, **fields: Any) -> Iterator[str]:
    """Start a local cluster (``disaggregated`` or ``colocated``) and yield its base URL.

    ``fields`` are config fields of any section (``ServeConfig.from_fields``:
    ``threads_per_worker``, ``cpu_affinity``, ``max_running``, ...).
    """
    from splitserve.config import ServeConfig
    from splitserve.config.flags import parse_cpu_affinity
    from splitserve.launch.local import Cluster

    if isinstance(fields.get("cpu_affinity"), str | list):
        fields["cpu_affinity"] = parse_cpu_affinity(fields["cpu_affinity"])
    if mode not in ("disaggregated", "colocated"):
        raise ValueError(f"unknown cluster mode {mode!r}")
    port = int(free_tcp_addr().rsplit(":", 1)[1])
    config = ServeConfig.from_fields(
        model=model_path, colocated=(mode == "colocated"), port=port, dtype=dtype, **fields
    )
    print(f"starting splitserve {mode} cluster on {config.url} ({dtype}) ...", flush=True)
    with Cluster(config) as cluster:
        yield config.url
        cluster.check_alive()
