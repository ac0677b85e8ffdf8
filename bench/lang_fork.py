"""Fork-heavy lang program vs the same prompts sent as independent requests.

Each input: a shared few-shot prefix, the input, then ``fork(8)`` with a short answer per branch.
``lang`` sends the batch's shared prefix once (``run_batch``), each input's prefix once (``fork``)
and then the branches; the baseline sends every branch's full prompt as its own request, with the
same concurrency. The ratio measures what prefix reuse saves, so it is only meaningful on a server
with the radix prefix cache (``cached_tokens`` > 0 below); without one, lang does slightly *more*
work (the warm-up requests) and the ratio is about 1 or below.

    python bench/lang_fork.py --num-inputs 64            # launches a colocated cluster
    python bench/lang_fork.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import time
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
# Different first lines: neither run can reuse what the other left in the cache (there is no
# flush endpoint), so each starts cold for its own prefix.
SALT_BASE, SALT_LANG = "Tips list A.\n", "Tips list B.\n"
NUM_BRANCHES = 8
MAX_TOKENS = 6


@lang.function
def tips(s, topic: str, salt: str):
    s += salt + FEW_SHOT + f"Topic: {topic}\n"
    forks = s.fork(NUM_BRANCHES)
    for i, f in enumerate(forks):
        f += f"Tip {i + 1}:" + lang.gen("tip", max_tokens=MAX_TOKENS, stop="\n")
    forks.join()
    return forks


def branch_prompt(topic: str, i: int, salt: str) -> str:
    return salt + FEW_SHOT + f"Topic: {topic}\nTip {i + 1}:"


def run_lang(url: str, topics: list[str], threads: int) -> tuple[float, int]:
    backend = lang.Endpoint(url)
    t0 = time.perf_counter()
    out = tips.run_batch([{"topic": t, "salt": SALT_LANG} for t in topics], backend=backend,
                         temperature=0,
                         num_threads=threads)
    wall = time.perf_counter() - t0
    cached = 0
    for s in out:
        if isinstance(s, lang.ProgramError):
            raise s
        cached += sum(f.meta("tip")["cached_tokens"] for f in s.return_value)
    return wall, cached


def run_independent(url: str, topics: list[str], threads: int) -> tuple[float, int]:
    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256))

    def one(prompt: str) -> int:
        body = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "stop": ["\n"]}
        r = client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    prompts = [branch_prompt(t, i, SALT_BASE) for t in topics for i in range(NUM_BRANCHES)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads * NUM_BRANCHES) as pool:
        cached = sum(pool.map(one, prompts))
    return time.perf_counter() - t0, cached


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: launch a colocated cluster)")
    p.add_argument("--num-inputs", type=int, default=64)
    p.add_argument("--threads", type=int, default=8, help="programs in flight at once")
    args = p.parse_args()
    topics = [TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" #{i}")
              for i in range(args.num_inputs)]
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from splitserve.default_model import ensure_default_model
            from splitserve.launcher import Cluster, ClusterSpec

            spec = ClusterSpec(model_path=str(ensure_default_model()), colocated=True,
                               port=_free_port())
            stack.enter_context(Cluster(spec))
            url = spec.url
        base_wall, base_cached = run_independent(url, topics, args.threads)
        lang_wall, lang_cached = run_lang(url, topics, args.threads)
    n = args.num_inputs * NUM_BRANCHES
    print(f"{args.num_inputs} inputs x {NUM_BRANCHES} branches = {n} generations")
    print(f"independent requests: {base_wall:7.2f} s   cached_tokens {base_cached}")
    print(f"lang run_batch+fork : {lang_wall:7.2f} s   cached_tokens {lang_cached}")
    print(f"speed-up (independent / lang): {base_wall / lang_wall:.2f}x")
    if lang_cached == 0:
        print("note: the server reported no cached tokens (no prefix cache yet): the ratio "
              "does not measure prefix reuse")


if __name__ == "__main__":
    main()
