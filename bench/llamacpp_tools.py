"""llama.cpp's command-line tools as measured peers: the GGUFs ``peers/llamacpp.sh`` makes,
``llama-perplexity``'s final estimate and ``llama-bench``'s prompt-processing rate.

The build and the GGUFs are the script's (``bash bench/peers/llamacpp.sh convert``, the
llama.cpp vendored in the ``llama-cpp-python`` sdist, built once under ``$LLAMACPP_DIR``,
default ``~/.cache/splitserve/llamacpp``, with the script's ``LLAMACPP_*`` environment); these
helpers run it and parse what the tools print. Imported as ``llamacpp_tools`` by the scripts in ``bench/`` (run as files).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "peers" / "llamacpp.sh"
PPL_RE = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS_RE = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+)")
KL_PPL_RE = re.compile(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)\s*±\s*([0-9.]+)")
KL_TOP_RE = re.compile(r"Same top p:\s*([0-9.]+)\s*±\s*([0-9.]+)\s*%")
KL_KLD_RE = re.compile(r"Mean\s+KLD:\s*([0-9.]+)\s*±\s*([0-9.]+)")


def gguf_paths(types: list[str]) -> dict[str, Path]:
    """Build the tools if need be and make the GGUF of every weight type in ``types`` (``f16``,
    ``q8_0``, ``q4_k_m``, ...) with ``llamacpp.sh convert`` (both cached across runs).

    Returns:
        ``{type: path of its GGUF}``, in ``types`` order.

    Raises:
        subprocess.CalledProcessError: the build or a conversion failed (its log, on stderr,
            passes through to ours).
    """
    env = {**os.environ, "LLAMACPP_OUTTYPE": " ".join(types)}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "convert"], env=env, check=True, stdout=subprocess.PIPE, text=True
    )  # stdout: one path per type
    paths = [Path(line) for line in proc.stdout.splitlines()[-len(types) :]]
    for path in paths:
        if path.suffix != ".gguf" or not path.is_file():
            raise RuntimeError(f"llamacpp.sh convert printed {path}, not a GGUF file")
    return dict(zip(types, paths, strict=True))


def bin_dir() -> Path:
    """The folder of the built tools, as ``llamacpp.sh`` (and its ``LLAMACPP_*`` environment)
    names it."""
    out = subprocess.run(
        ["bash", str(SCRIPT), "bindir"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return Path(out.strip())


def run_tool(name: str, args: list[str]) -> tuple[str, str]:
    """Run ``name args`` from :func:`bin_dir` and return its stdout and its stderr (where the log goes).

    Raises:
        RuntimeError: the tool failed, with its exit status and the end of its output (a
            negative status is the signal that killed it, e.g. -4 for an illegal instruction).
    """
    proc = subprocess.run(
        [str(bin_dir() / name), *args],
        check=False,
        capture_output=True,
        encoding="utf-8",
        errors="replace",
    )  # utf-8 whatever the locale: the statistics print "±"
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"{name} exited with {proc.returncode}: {tail}")
    return proc.stdout, proc.stderr


def perplexity(
    gguf: Path, text_file: Path, ctx: int, threads: int, save_logits: Path | None = None
) -> dict[str, float]:
    """``llama-perplexity`` of ``gguf`` on the text in ``text_file``, chunks of ``ctx`` tokens;
    with ``save_logits``, its log-probabilities of the scored positions are written there
    (``--kl-divergence-base``, for :func:`kl_divergence`: about ``tokens / 2 * vocab * 2``
    bytes, 200 MB for 4096 tokens of SmolLM2).

    llama.cpp tokenizes the whole file, splits it into ``len(tokens) // ctx`` chunks (it needs
    at least ``2 * ctx`` tokens), evaluates each from an empty context and scores only the second
    half of every chunk, so each scored token sees at least ``ctx / 2`` tokens of context.

    Returns:
        ``{"ppl": final estimate, "err": its +/-, "chunks": chunks scored, "ctx": ctx}``.

    Raises:
        RuntimeError: the tool failed or printed no final estimate.
    """
    args = ["-m", gguf, "-f", text_file, "-c", ctx, "-t", threads, "-tb", threads]
    if save_logits is not None:
        args += ["--kl-divergence-base", save_logits]
    out = "".join(run_tool("llama-perplexity", [str(a) for a in args]))
    m = PPL_RE.search(out)
    if not m:
        raise RuntimeError(f"llama-perplexity printed no final estimate: {out[-2000:]}")
    chunks = CHUNKS_RE.search(out)
    return {
        "ppl": float(m.group(1)),
        "err": float(m.group(2)),
        "chunks": int(chunks.group(1)) if chunks else -1,
        "ctx": ctx,
    }


def kl_divergence(gguf: Path, base_logits: Path, ctx: int, threads: int) -> dict[str, float]:
    """``llama-perplexity --kl-divergence`` of ``gguf`` against the log-probabilities a
    :func:`perplexity` run saved in ``base_logits`` (same tokens, same chunks, same positions).

    Its "Mean PPL(base)" is not returned: the saved log-probabilities are clamped at 16 nats
    below each position's best (llama.cpp's storage format), which lowers the base's perplexity
    (3.89 against the base run's own 3.95 on 1024 GSM8K tokens); ``gguf``'s own perplexity is
    computed from its full logits, like :func:`perplexity`'s, so compare it with that.

    Returns:
        ``{"ppl", "err"}`` (``gguf``'s perplexity on those positions), ``{"same_top",
        "same_top_err"}`` (% of positions whose most likely token is the base's: top-1
        agreement), ``"kld"`` (mean KL divergence from the base, nats) and ``"chunks"``.

    Raises:
        RuntimeError: the tool failed or printed no statistics.
    """
    args = [
        "-m",
        gguf,
        "--kl-divergence",
        "--kl-divergence-base",
        base_logits,
        "-c",
        ctx,
        "-t",
        threads,
        "-tb",
        threads,
    ]
    out = "".join(run_tool("llama-perplexity", [str(a) for a in args]))
    ppl, top, kld = KL_PPL_RE.search(out), KL_TOP_RE.search(out), KL_KLD_RE.search(out)
    if not (ppl and top and kld):
        raise RuntimeError(f"llama-perplexity --kl-divergence printed no statistics: {out[-2000:]}")
    chunks = CHUNKS_RE.search(out)
    return {
        "ppl": float(ppl.group(1)),
        "err": float(ppl.group(2)),
        "same_top": float(top.group(1)),
        "same_top_err": float(top.group(2)),
        "kld": float(kld.group(1)),
        "chunks": int(chunks.group(1)) if chunks else -1,
        "ctx": ctx,
    }


def bench_prompt(gguf: Path, lengths: list[int], threads: int, reps: int) -> dict[int, dict]:
    """``llama-bench -p LENGTHS -n 0``: prompt processing only, in process (no HTTP, no
    tokenization), ``reps`` repetitions per length.

    Returns:
        ``{prompt length: {"tok_s": mean tokens/s, "std": its standard deviation,
        "build": llama.cpp build commit, "cpu": the CPU llama-bench saw}}``.

    Raises:
        RuntimeError: the tool failed or its JSON lacks a length asked for.
    """
    prompts = ",".join(map(str, lengths))
    args = ["-m", gguf, "-p", prompts, "-n", 0, "-t", threads, "-r", reps, "-o", "json"]
    out, log = run_tool("llama-bench", [str(a) for a in args])
    rows = json.loads(out)
    result = {
        int(r["n_prompt"]): {
            "tok_s": float(r["avg_ts"]),
            "std": float(r["stddev_ts"]),
            "build": r.get("build_commit", "?"),
            "cpu": r.get("cpu_info", "?"),
        }
        for r in rows
        if int(r.get("n_gen", 0)) == 0
    }
    missing = [n for n in lengths if n not in result]
    if missing:
        raise RuntimeError(f"llama-bench reported no prompt rate for {missing}: {log[-2000:]}")
    return result
