"""Fork-heavy lang program vs the same prompts sent as independent requests, cache off.

Each input: a shared few-shot prefix, the input, then ``fork(8)`` with a short answer per branch.
``lang`` sends the batch's shared prefix once (``run_batch``), each input's prefix once (``fork``)
and then the branches, to a server with the radix prefix cache (flushed first). The baseline sends
every branch's full prompt as its own request, at the same concurrency, to a server started with
``--disable-radix-cache``: nothing is reused, as if the cache were flushed before each request
(issue 5's baseline). Both clusters are launched one after the other, so they never share the CPUs.

    python bench/lang_fork.py --num-inputs 64            # launches both clusters (colocated)
    python bench/lang_fork.py --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx

from splitserve import lang

FEW_SHOT = "".join(
    f"Topic: {t}\nTip: {tip}\n\n"
    for t, tip in [
        ("sleep", "Keep the same bedtime every day, weekends included."),
        ("focus", "Work in 25-minute blocks and silence notifications."),
        ("running", "Increase your weekly distance by at most ten percent."),
        ("cooking", "Read the whole recipe before you start chopping anything."),
        ("saving money", "Move a fixed share of each paycheck to savings on payday."),
        ("learning", "Explain what you learned to someone else the same day."),
    ]
)
TOPICS = ["gardening", "public speaking", "writing", "hiking", "chess", "travel", "painting",
          "swimming", "baking", "photography", "negotiation", "time management"]
NUM_BRANCHES = 8
MAX_TOKENS = 6


@lang.function
def tips(s, topic: str):
    s += FEW_SHOT + f"Topic: {topic}\n"
    forks = s.fork(NUM_BRANCHES)
    for i, f in enumerate(forks):
        f += f"Tip {i + 1}:" + lang.gen("tip", max_tokens=MAX_TOKENS, stop="\n")
    forks.join()
    return forks


def branch_prompt(topic: str, i: int) -> str:
    """The full prompt branch ``i`` of :func:`tips` sends for ``topic``."""
    return FEW_SHOT + f"Topic: {topic}\nTip {i + 1}:"


def run_lang(url: str, topics: list[str], threads: int) -> tuple[float, int, list[str]]:
    """Wall seconds, cached prompt tokens summed over the branches, and the branches' tips."""
    httpx.post(url + "/flush_cache", json={}, timeout=60).raise_for_status()
    backend = lang.Endpoint(url)
    t0 = time.perf_counter()
    out = tips.run_batch([{"topic": t} for t in topics], backend=backend, temperature=0,
                         num_threads=threads)
    wall = time.perf_counter() - t0
    cached, texts = 0, []
    for s in out:
        if isinstance(s, lang.ProgramError):
            raise s
        cached += sum(f.meta("tip")["cached_tokens"] for f in s.return_value)
        texts += [f["tip"] for f in s.return_value]
    return wall, cached, texts


def run_independent(url: str, topics: list[str], threads: int) -> tuple[float, int, list[str]]:
    """Every branch prompt as one ``/v1/completions`` request, ``threads * 8`` in flight."""
    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256))

    def one(prompt: str) -> tuple[int, str]:
        body = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "stop": ["\n"]}
        r = client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        out = r.json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["text"]

    prompts = [branch_prompt(t, i) for t in topics for i in range(NUM_BRANCHES)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads * NUM_BRANCHES) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    return wall, sum(c for c, _ in results), [t for _, t in results]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _cluster(args: argparse.Namespace, disable_radix_cache: bool) -> Iterator[str]:
    from splitserve.config import ServeConfig
    from splitserve.default_model import ensure_default_model
    from splitserve.launch.local import Cluster

    config = ServeConfig.from_fields(
        model=str(ensure_default_model()), colocated=True, port=_free_port(), dtype=args.dtype,
        prefix_cache="none" if disable_radix_cache else "radix",
    )
    with Cluster(config):
        yield config.url


def main() -> None:
    from common import resolve_bench_dtype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running splitserve server with the radix cache, for lang")
    p.add_argument("--baseline-url", help="a running server without a prefix cache "
                   "(--disable-radix-cache), for the independent requests")
    p.add_argument("--num-inputs", type=int, default=64)
    p.add_argument("--threads", type=int, default=8, help="programs in flight at once")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="dtype of launched clusters")
    args = p.parse_args()
    if (args.url is None) != (args.baseline_url is None):
        p.error("give both --url and --baseline-url, or neither (both clusters are launched)")
    args.dtype, why = resolve_bench_dtype(args.dtype)
    topics = [TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" #{i}")
              for i in range(args.num_inputs)]
    with contextlib.ExitStack() as stack:
        url = args.baseline_url or stack.enter_context(_cluster(args, disable_radix_cache=True))
        base_wall, base_cached, base_texts = run_independent(url, topics, args.threads)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(_cluster(args, disable_radix_cache=False))
        lang_wall, lang_cached, lang_texts = run_lang(url, topics, args.threads)
    n = args.num_inputs * NUM_BRANCHES
    same = sum(a == b for a, b in zip(base_texts, lang_texts, strict=True))
    print(f"{args.num_inputs} inputs x {NUM_BRANCHES} branches = {n} generations, "
          f"{args.threads} programs in flight, dtype {args.dtype} ({why})")
    print(f"independent requests, cache off: {base_wall:7.2f} s   cached_tokens {base_cached}")
    print(f"lang run_batch + fork, cache on: {lang_wall:7.2f} s   cached_tokens {lang_cached}")
    print(f"speed-up (independent / lang): {base_wall / lang_wall:.2f}x   (goal >= 3x)")
    print(f"greedy tips identical in both runs: {same}/{n}")
    if base_cached:
        print("note: the baseline server reused cached tokens: it is not a cache-off baseline")


if __name__ == "__main__":
    main()
