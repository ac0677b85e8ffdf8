"""The prefix cache inside the scheduler, with the real default model in-process: greedy outputs
are identical with the cache on and off, hits are where the page geometry says, and every page
comes back (to the pool or to the cache's evictable set)."""

from __future__ import annotations

import pytest

from splitserve.engine.core import EngineCore
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from tests.engine_core import make_core

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PAGE_SIZE = 4
NEW_TOKENS = 6
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_core_for(model, cache: str, num_pages: int = 256, prefill_only: bool = False):
    net, cfg = model
    pool = KVPool(cfg.kv_layout(PAGE_SIZE, "float32"), num_pages)
    return make_core(net, pool, cfg.eos_token_ids, cache, max_batch_tokens=64, max_running=8,
                     prefill_only=prefill_only)


def run(core: EngineCore, prompts: list[list[int]], together: bool = False) -> list[Req]:
    """Generate for each prompt, one after another (or all queued at once); returns the requests.
    A prefill-only scheduler's requests are freed right after their first token, as the prefill
    worker does after the KV send."""
    sched = core.scheduler
    reqs = [Req(f"r{i}", list(p), GREEDY) for i, p in enumerate(prompts)]
    batches = [reqs] if together else [[r] for r in reqs]
    for batch in batches:
        for r in batch:
            sched.add(r)
        for _ in range(500):
            if not sched.has_work:
                break
            for out in core.step():
                if out.prefilled:
                    sched.release(out.req)
            sched.check_pages()  # every used page is the cache's or a queued request's
        assert not sched.has_work
    return reqs


# A shared trunk, then prompts diverging from it at every position relative to the page size.
TRUNK = [1, 504, 3458, 282, 4649, 314, 260, 3575, 282, 2545, 28, 457, 9876, 30, 2]


def _prompts() -> list[tuple[str, list[int], list[int]]]:
    """(case, first prompt, second prompt); the two share exactly the named prefix."""
    tail_a, tail_b = [2110, 314, 1345], [7721, 88, 1203]
    cases = []
    for name, shared in [
        ("shorter_than_page", 3),
        ("exactly_page", 4),
        ("page_plus_one", 5),
        ("three_pages", 12),
    ]:
        cases.append((name, TRUNK[:shared] + tail_a, TRUNK[:shared] + tail_b))
    cases.append(("identical_aligned", TRUNK[:8], TRUNK[:8]))
    cases.append(("identical_unaligned", TRUNK[:11], TRUNK[:11]))
    return cases


CASES = _prompts()


@pytest.fixture(scope="module")
def reference(model) -> dict[str, list[list[int]]]:
    """Outputs with the cache off."""
    core = make_core_for(model, "none")
    return {name: [r.output_ids for r in run(core, [a, b])] for name, a, b in CASES}


@pytest.mark.parametrize("prefill_only", [False, True], ids=["colocated", "prefill"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_greedy_tokens_with_cache(model, reference, case, prefill_only) -> None:
    name, a, b = case
    core = make_core_for(model, "radix", prefill_only=prefill_only)
    sched = core.scheduler
    first, second = run(core, [a, b])
    want = reference[name]
    n = 1 if prefill_only else NEW_TOKENS
    assert [first.output_ids[:n], second.output_ids[:n]] == [w[:n] for w in want]
    shared = sum(1 for x, y in zip(a, b) if x == y) if a != b else len(a)
    # At most the last token is recomputed; only whole pages are reused.
    assert second.cached_len == min(shared, len(b) - 1) // PAGE_SIZE * PAGE_SIZE
    assert first.cached_len == 0
    stats = sched.cache.stats()
    assert sched.allocator.num_used == stats.cached_pages == stats.evictable_pages
    sched.cache.flush()
    assert sched.allocator.num_used == 0


def test_batched_and_repeated_prompts_match(model, reference) -> None:
    prompts = [p for _, a, b in CASES for p in (a, b)]
    core = make_core_for(model, "radix")
    sched = core.scheduler
    together = run(core, prompts, together=True)
    again = run(core, prompts)  # now everything is cached
    want = [out for name, _, _ in CASES for out in reference[name]]
    assert [r.output_ids for r in together] == want
    assert [r.output_ids for r in again] == want
    assert all(r.cached_len > 0 for r in again if r.prompt_len > PAGE_SIZE)
    sched.cache.tree.check_integrity()


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_small_pool_evicts_and_waits(model, reference, cache) -> None:
    """A pool that holds only a few sequences: the cache evicts, requests wait or are retracted,
    none fails (with the cache off too: retraction alone must cope)."""
    prompts = [p for _, a, b in CASES for p in (a, b)]
    core = make_core_for(model, cache, num_pages=12)  # 11 usable pages of 4 tokens
    sched = core.scheduler
    reqs = run(core, prompts, together=True)
    assert [r.output_ids for r in reqs] == [o for n, _, _ in CASES for o in reference[n]]
    assert sched.num_retracted > 0
    if cache == "radix":
        assert sched.cache.stats().evicted_pages > 0
    assert sched.allocator.num_used == sched.cache.stats().evictable_pages
    sched.cache.flush()
    assert sched.allocator.num_used == 0


@pytest.mark.parametrize("prefill_only", [False, True], ids=["colocated", "prefill"])
def test_running_request_shares_its_prefix(model, reference, prefill_only) -> None:
    """A prompt's KV is reusable as soon as it is computed, before its request is released."""
    name, a, b = CASES[3]  # three shared pages
    core = make_core_for(model, "radix", prefill_only=prefill_only)
    sched = core.scheduler
    first, second = Req("a", list(a), GREEDY), Req("b", list(b), GREEDY)
    sched.add(first)
    outs = core.step()  # prefills ``first``; it keeps running (or awaits its KV send)
    assert first.page_ids and first.kv_len == len(a)
    sched.add(second)
    while sched.has_work:
        outs += core.step()
    assert second.cached_len == 12
    assert second.output_ids[:1] == reference[name][1][:1]
    for out in outs:
        if out.prefilled:
            sched.release(out.req)
    if not prefill_only:
        assert [first.output_ids, second.output_ids] == reference[name]
    assert sched.allocator.num_used == sched.cache.stats().evictable_pages


def test_prompt_logprobs_are_computed_not_cached(model) -> None:
    """A request asking for prompt logprobs matches only what it does not need to score."""
    prompt = TRUNK[:13]
    scored = SamplingParams(max_new_tokens=2, temperature=0.0, logprob_start_len=6)
    results = {}
    for cache in ("none", "radix"):
        core = make_core_for(model, cache)
        sched = core.scheduler
        run(core, [prompt])  # warms the cache (3 pages)
        req = Req("scored", list(prompt), scored)
        sched.add(req)
        while sched.has_work:
            core.step()
        results[cache] = req
    warm, cold = results["radix"], results["none"]
    assert warm.cached_len == 4  # position 5 predicts token 6: pages past it are recomputed
    assert len(warm.prompt_logprobs) == len(prompt) - 6
    assert warm.prompt_logprobs == pytest.approx(cold.prompt_logprobs, abs=1e-4)
    assert warm.output_ids == cold.output_ids
