"""The bfloat16 head-major decode path (decode_attention + decode_kv_cache) against a float32
dense reference, over several steps in which sequences join, leave, extend and come back, and
the decode cache against the gather path it replaces; speculative verify steps run as decode
rows sharing a slot, then partly rejected, with no copy from the pool."""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference

from splitserve.engine.attention.decode_kv_cache import RESERVE_AHEAD, DecodeKVCache, reserve_len
from splitserve.engine.attention.torch_backend import TorchAttentionBackend
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for

PAGE = 4
LAYERS = 2
# bf16 inputs (q, K, V) are exact in both; the difference is the bf16 rounding of scores,
# probabilities and output: ~3 significant bits of slack on values of magnitude ~1.
TOL = 3e-2


class Sim:
    """Sequences of random bf16 K/V (per layer) growing in one pool; runs steps through a
    backend with or without sequence ids and checks every token against the reference."""

    def __init__(self, hkv: int, group: int, window: int | None, num_seqs: int) -> None:
        self.hkv, self.hq, self.d, self.window = hkv, hkv * group, 16, window
        layout = KVLayout(LAYERS, hkv, self.d, PAGE, "bfloat16")
        self.pool = KVPool(layout, 256)
        self.lens = [0] * num_seqs  # tokens whose K/V are in the pool
        self.pages: list[list[int]] = [[] for _ in range(num_seqs)]
        shape = (LAYERS, 64, hkv, self.d)  # up to 64 tokens per sequence
        self.k = [torch.randn(shape).to(torch.bfloat16) for _ in range(num_seqs)]
        self.v = [torch.randn(shape).to(torch.bfloat16) for _ in range(num_seqs)]

    def step(self, backend: TorchAttentionBackend, rows: list[int], chunks: list[int],
             with_ids: bool, max_lens: list[int] | None = None,
             as_decode_rows: bool = False) -> list[torch.Tensor]:
        """Extend ``rows`` by ``chunks`` tokens (``max_lens``: the most KV each can reach;
        ``as_decode_rows``: one decode row per token, ``ForwardBatch.as_decode_rows``);
        returns each layer's output ``[T, Hq, D]``."""
        for i, n in zip(rows, chunks, strict=True):
            need = pages_for(self.lens[i] + n, PAGE) - len(self.pages[i])
            self.pages[i] += self.pool.allocator.alloc(need)
        batch = build_forward_batch(
            [[0] * n for n in chunks], [self.lens[i] for i in rows],
            [self.pages[i] for i in rows], PAGE, [], "cpu",
            seq_ids=rows if with_ids else None, max_seq_lens=max_lens,
        )
        if as_decode_rows:
            batch = batch.as_decode_rows()
        meta = backend.prepare(batch, self.pool, self.window)
        outs, scale = [], self.d**-0.5
        q = torch.randn(LAYERS, sum(chunks), self.hq, self.d).to(torch.bfloat16)
        for layer in range(LAYERS):
            k = torch.cat([self.k[i][layer, self.lens[i] : self.lens[i] + n]
                           for i, n in zip(rows, chunks)])
            v = torch.cat([self.v[i][layer, self.lens[i] : self.lens[i] + n]
                           for i, n in zip(rows, chunks)])
            out = backend.forward(q[layer], k, v, layer, meta, self.pool, scale)
            self.check(q[layer], out, layer, rows, chunks)
            outs.append(out)
        for i, n in zip(rows, chunks):
            self.lens[i] += n
        return outs

    def reject(self, i: int, num: int) -> None:
        """Drop sequence ``i``'s last ``num`` tokens, as a verify step that rejects its last
        ``num`` drafted positions: the tokens that come there next have other K/V."""
        self.lens[i] -= num
        end = self.lens[i]
        self.k[i][:, end:] = torch.randn_like(self.k[i][:, end:], dtype=torch.float32).bfloat16()
        self.v[i][:, end:] = torch.randn_like(self.v[i][:, end:], dtype=torch.float32).bfloat16()

    def check(self, q, out, layer, rows, chunks) -> None:
        t = 0
        for i, n in zip(rows, chunks):
            for j in range(n):
                end = self.lens[i] + j + 1
                ref = reference(q[t], self.k[i][layer, :end], self.v[i][layer, :end],
                                self.window, self.d**-0.5)
                assert torch.allclose(out[t].float(), ref, atol=TOL, rtol=TOL), (layer, i, j)
                t += 1


# (rows, chunks) per step: prefill, decode-only steps, a row leaving and coming back (its
# slot is dropped and refilled), a mixed step (a row extends 3 tokens: the cache must re-copy
# it), a late joiner taking a free slot, and rows out of slot order.
SCHEDULE = [
    ([0, 1, 2, 3], [5, 9, 2, 13]),
    ([0, 1, 2, 3], [1, 1, 1, 1]),
    ([0, 1, 2, 3], [1, 1, 1, 1]),
    ([0, 2, 3], [1, 1, 1]),
    ([3, 1, 0, 2], [1, 1, 1, 1]),
    ([0, 1, 2, 3, 4], [1, 3, 1, 1, 7]),
    ([4, 3, 2, 1, 0], [1, 1, 1, 1, 1]),
    ([1, 4], [1, 1]),
    ([2, 0, 1, 4], [1, 1, 1, 1]),
]


@pytest.mark.parametrize("hkv,group", [(3, 3), (1, 4), (4, 1)])  # GQA, MQA, MHA
@pytest.mark.parametrize("window", [None, 6])
def test_decode_cache_matches_reference_and_gather(hkv, group, window) -> None:
    torch.manual_seed(0)
    cached, gathered = Sim(hkv, group, window, 5), Sim(hkv, group, window, 5)
    for sim in (cached, gathered):  # same K/V in both
        sim.k, sim.v = [t.clone() for t in cached.k], [t.clone() for t in cached.v]
    with_cache, without = TorchAttentionBackend(), TorchAttentionBackend()
    for rows, chunks in SCHEDULE:
        torch.manual_seed(len(rows) * 100 + sum(chunks))
        a = cached.step(with_cache, rows, chunks, with_ids=True)
        torch.manual_seed(len(rows) * 100 + sum(chunks))
        b = gathered.step(without, rows, chunks, with_ids=False)
        for x, y in zip(a, b):
            # Same inputs, same product shapes per (row, head): equal up to the products'
            # blocking over the (masked, padded) key positions.
            assert torch.allclose(x.float(), y.float(), atol=1e-2, rtol=1e-2)
    cache = with_cache.decode_cache
    assert cache is not None and set(cache.slot_of) == {2, 0, 1, 4}


# Speculative steps (rows, chunks, rejected positions per row): a chunk of 1 + K is a verify of
# K drafts; after it all but the kept drafts and the next token are rejected.
VERIFY_SCHEDULE = [
    ([0, 1, 2], [1, 5, 1], [0, 3, 0]),  # row 1 keeps 1 of 4 drafts
    ([0, 1, 2], [3, 1, 4], [2, 0, 0]),  # every draft of row 2 kept
    ([2, 0, 1], [5, 2, 1], [4, 0, 0]),  # rows out of slot order; row 2 keeps none
    ([0, 1, 2], [1, 1, 1], [0, 0, 0]),  # plain decode after the rejections
    ([1, 0], [4, 1], [1, 0]),  # row 2 leaves
]


@pytest.mark.parametrize("use_cpu_kernels", [True, False])
@pytest.mark.parametrize("window", [None, 6])
def test_verify_steps_as_decode_rows_share_a_slot(monkeypatch, use_cpu_kernels, window) -> None:
    """A verify step run as one decode row per drafted position (``as_decode_rows``): each row
    attends to its sequence up to its own position, the drafts before it included, through the
    decode cache (the C kernel, or the torch products' per-row path); after a partial
    acceptance the rejected positions' stale K/V are overwritten before they are read, so no
    sequence is copied from the pool again once it decodes."""
    torch.manual_seed(0)
    sim = Sim(2, 3, window, 3)
    backend = TorchAttentionBackend(use_cpu_kernels=use_cpu_kernels)
    copies: list[int] = []
    real_fill = DecodeKVCache._fill

    def counting_fill(self, slot, num_tokens, pages):
        copies.append(num_tokens)
        return real_fill(self, slot, num_tokens, pages)

    monkeypatch.setattr(DecodeKVCache, "_fill", counting_fill)
    sim.step(backend, [0, 1, 2], [7, 10, 3], with_ids=True, max_lens=[40, 40, 40])
    sim.step(backend, [0, 1, 2], [1, 1, 1], with_ids=True, max_lens=[40, 40, 40])
    assert len(copies) == 3  # each sequence copied in once, when it starts decoding
    for rows, chunks, rejected in VERIFY_SCHEDULE:
        sim.step(backend, rows, chunks, with_ids=True, max_lens=[40] * len(rows),
                 as_decode_rows=True)  # every output checked against the reference
        for i, num in zip(rows, rejected):
            sim.reject(i, num)
    assert len(copies) == 3, copies
    cache = backend.decode_cache
    assert cache is not None and set(cache.slot_of) == {0, 1}
    # Rows of one sequence that are not consecutive, one position apart, are refused.
    pages = torch.zeros(3, 4, dtype=torch.long)
    assert cache.plan([5, 6, 5], [3, 3, 4], pages, None) is None


def test_decode_cache_respects_its_memory_bound() -> None:
    torch.manual_seed(0)
    sim = Sim(2, 2, None, 3)
    backend = TorchAttentionBackend()
    # Three slots of 32 positions need 2 * LAYERS * 3 * 2 * 16 * 32 * 2 bytes = 24 KiB.
    cache = backend.decode_cache = DecodeKVCache(sim.pool, max_bytes=16 * 1024)
    sim.step(backend, [0, 1, 2], [9, 9, 9], with_ids=True)
    sim.step(backend, [0, 1, 2], [1, 1, 1], with_ids=True)  # too big: gathered (and checked)
    assert cache.nbytes == 0 and not cache.slot_of
    sim.step(backend, [0, 1], [1, 1], with_ids=True)  # two slots fit
    assert 0 < cache.nbytes <= cache.max_bytes and set(cache.slot_of) == {0, 1}
    sim.step(backend, [0, 1, 2], [2, 2, 2], with_ids=True)  # no decode rows: memory freed
    assert cache.nbytes == 0


def test_interrupted_step_drops_the_cache() -> None:
    torch.manual_seed(0)
    sim = Sim(2, 2, None, 2)
    backend = TorchAttentionBackend()
    sim.step(backend, [0, 1], [6, 2], with_ids=True)
    sim.step(backend, [0, 1], [1, 1], with_ids=True)
    cache = backend.decode_cache
    assert isinstance(cache, DecodeKVCache)
    # A step planned but never run (as if the forward raised before any layer): the next plan
    # must not trust the half-written cache.
    batch = build_forward_batch([[0], [0]], sim.lens, sim.pages, PAGE, [], seq_ids=[0, 1])
    backend.prepare(batch, sim.pool, None)
    assert cache._layers_left == LAYERS
    sim.step(backend, [0, 1], [1, 1], with_ids=True)  # re-copies both rows from the pool
    assert cache._layers_left == 0 and set(cache.slot_of) == {0, 1}


@pytest.mark.parametrize("use_cpu_kernels", [True, False])
def test_cache_grows_only_when_a_sequence_is_admitted(use_cpu_kernels) -> None:
    """With each sequence's final length known, the cache's buffers are replaced only in steps
    that admit a sequence (its prompt step), never while it decodes; the outputs still match
    the reference (the torch path reads the reserved, masked positions: they must be finite)."""
    torch.manual_seed(0)
    sim = Sim(3, 3, None, 4)
    backend = TorchAttentionBackend(use_cpu_kernels=use_cpu_kernels)
    final = [40, 30, 64, 50]  # prompt + max_new_tokens - 1 of each sequence
    prompts = [5, 9, 20, 3]
    replaced_in = []  # (step, admitted a sequence)
    for step in range(100):  # sequence i arrives at step 8 * i
        live = [i for i in range(4) if 0 < sim.lens[i] < final[i]]
        new = [i for i in range(4) if sim.lens[i] == 0 and step >= 8 * i]
        rows = live + new
        if not rows:
            break
        chunks = [1] * len(live) + [prompts[i] for i in new]
        before = None if backend.decode_cache is None else backend.decode_cache.kt
        sim.step(backend, rows, chunks, with_ids=True, max_lens=[final[i] for i in rows])
        cache = backend.decode_cache
        if cache is not None and cache.kt is not before:
            replaced_in.append((step, bool(new)))
    assert sim.lens == final
    assert replaced_in and all(admits for _, admits in replaced_in), replaced_in
    assert len(replaced_in) <= 4  # at most one growth per admitted sequence


def test_reservation_is_clipped_to_the_memory_bound() -> None:
    torch.manual_seed(0)
    sim = Sim(2, 2, None, 2)
    backend = TorchAttentionBackend()
    # 2 slots x 128 positions: 2 * LAYERS * 2 * 2 * 16 * 128 * 2 bytes = 32 KiB; a final
    # length of 1000 would need far more: the cache reserves what fits (in the prompt step),
    # keeps it, and still serves the steps.
    cache = backend.decode_cache = DecodeKVCache(sim.pool, max_bytes=32 * 1024)
    sim.step(backend, [0, 1], [9, 5], with_ids=True, max_lens=[1000, 1000])
    kt = cache.kt
    assert kt is not None and cache.nbytes == cache.max_bytes
    for _ in range(8):
        sim.step(backend, [0, 1], [1, 1], with_ids=True, max_lens=[1000, 1000])
        assert cache.kt is kt and set(cache.slot_of) == {0, 1}


def test_reserve_len() -> None:
    assert reserve_len(10, None) == 10  # unknown: nothing ahead
    assert reserve_len(10, 137) == 137  # the final length, when it is near
    assert reserve_len(10, 8191) == 10 + RESERVE_AHEAD  # far off: a bounded step ahead
    assert reserve_len(1000, 8191) == 2000
    assert reserve_len(50, 40) == 50


def test_scheduler_tokens_equal_with_and_without_cache(model_path) -> None:
    """The default model in bfloat16 through the scheduler (chunked prefill interleaved with
    decodes, requests finishing at different steps): same greedy tokens either way."""
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.sched.request import Req
    from splitserve.ipc.messages import SamplingParams
    from tests.engine_core import make_core

    model, cfg = load_model(model_path, dtype=torch.bfloat16)

    def run(use_cache: bool) -> list[list[int]]:
        backend = model.attn_backend
        backend.use_decode_cache, backend.decode_cache = use_cache, None
        pool = KVPool(cfg.kv_layout(16, "bfloat16"), 200)
        core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=48, max_running=8)
        sched = core.scheduler
        g = torch.Generator().manual_seed(0)
        reqs = []
        for i in range(5):
            ids = torch.randint(100, 40000, (10 + 29 * i,), generator=g).tolist()
            params = SamplingParams(temperature=0.0, max_new_tokens=24 - 4 * i, ignore_eos=True)
            reqs.append(Req(rid=str(i), input_ids=ids, sampling=params))
            sched.add(reqs[-1])
        held = 0
        while sched.has_work:
            core.step()
            held = max(held, backend.cache_bytes())  # what /workers reports
        if use_cache:
            assert backend.decode_cache is not None
            # at least every layer's K and V of the longest sequence, in bfloat16
            assert held >= 2 * cfg.num_layers * cfg.kv_size * (10 + 29 * 4 + 8) * 2
        else:
            assert held == 0
        return [r.output_ids for r in reqs]

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run(True) == run(False)
    finally:
        torch.set_num_threads(before)


def test_scheduler_growth_only_at_admission(model_path) -> None:
    """Requests arriving while others decode (bfloat16, the default model): the decode cache's
    buffers are replaced only in steps that run a prompt (at most once per request), and the
    greedy tokens equal the gather path's."""
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.sched.request import Req
    from splitserve.ipc.messages import SamplingParams
    from tests.engine_core import make_core

    model, cfg = load_model(model_path, dtype=torch.bfloat16)
    # The first outgrows a capacity sized to its prompt before the others arrive.
    prompt_lens, new_tokens, arrivals = [7, 60, 23, 140], [60, 30, 48, 20], [0, 30, 36, 42]

    def run(use_cache: bool) -> tuple[list[list[int]], list[bool]]:
        backend = model.attn_backend
        backend.use_decode_cache, backend.decode_cache = use_cache, None
        pool = KVPool(cfg.kv_layout(16, "bfloat16"), 200)
        core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=64, max_running=8)
        sched = core.scheduler
        g = torch.Generator().manual_seed(1)
        reqs = [
            Req(rid=str(i), input_ids=torch.randint(100, 40000, (n,), generator=g).tolist(),
                sampling=SamplingParams(temperature=0.0, max_new_tokens=m, ignore_eos=True))
            for i, (n, m) in enumerate(zip(prompt_lens, new_tokens))
        ]
        replaced_in = []  # per replacement of the buffers: did its step run a prompt?
        step = 0
        while step <= arrivals[-1] or sched.has_work:
            for req, at in zip(reqs, arrivals):
                if at == step:
                    sched.add(req)
            before = None if backend.decode_cache is None else backend.decode_cache.kt
            batch = sched.schedule()
            if batch is not None:
                sched.update(batch, core.runner.run(batch))
                cache = backend.decode_cache
                if cache is not None and cache.kt is not None and cache.kt is not before:
                    replaced_in.append(any(n > 1 for n in batch.chunk_lens))
            step += 1
        return [r.output_ids for r in reqs], replaced_in

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (cached, replaced_in), (gathered, _) = run(True), run(False)
    finally:
        torch.set_num_threads(before)
    assert [len(t) for t in cached] == new_tokens
    assert cached == gathered
    assert replaced_in and all(replaced_in) and len(replaced_in) <= len(prompt_lens)


def test_tiled_cache_holds_the_same_keys_as_the_torch_layout() -> None:
    """A cache in the C kernels' key tiles against one in the torch layout over one pool:
    sequences copied in from the pool (lengths off the tile and page edges), tokens appended
    with the torch index arithmetic, a late joiner that makes both grow (the old tiles copied
    over): every key equal once the torch layout is re-tiled by plain reshaping."""
    from splitserve.engine.kernels.cpu.bindings import KT_TILE

    torch.manual_seed(3)
    layout = KVLayout(LAYERS, 3, 16, PAGE, "bfloat16")
    pool = KVPool(layout, 160)
    pool.buffer.copy_(torch.randn(pool.buffer.shape).to(torch.bfloat16))
    caches = [DecodeKVCache(pool, max_bytes=1 << 30, tiled=t) for t in (False, True)]
    lens = {0: 7, 1: 33, 2: 50}
    pages = {i: pool.allocator.alloc(pages_for(200, PAGE)) for i in range(3)}

    def step(ids: list[int], max_len: int) -> None:
        cover = pages_for(max(lens[i] for i in ids), PAGE)
        table = torch.tensor([pages[i][:cover] for i in ids], dtype=torch.long)
        for cache in caches:
            plan = cache.plan(ids, [lens[i] for i in ids], table, None, [max_len] * len(ids))
            assert plan is not None
            torch.manual_seed(sum(lens[i] for i in ids))  # the same new K/V for both caches
            for layer in range(LAYERS):
                k = torch.randn(len(ids), 3, 16).to(torch.bfloat16)
                cache.append(layer, plan, k, -k)
        for i in ids:
            lens[i] += 1

    step([0, 1], 40)
    step([0, 1], 40)
    first = caches[0].kt
    step([0, 1, 2], 180)  # the joiner's reservation (180) grows both caches
    step([2, 0, 1], 180)
    plain, tiled = caches
    assert plain.kt is not None and tiled.kt is not None and plain.kt is not first
    L, slots, hkv, d, cap = plain.kt.shape
    assert cap % KT_TILE == 0 and tiled.kt.shape == (L, slots, hkv, cap // KT_TILE, d, KT_TILE)
    retiled = plain.kt.view(L, slots, hkv, d, cap // KT_TILE, KT_TILE).permute(0, 1, 2, 4, 3, 5)
    for i in range(3):
        slot, n = plain.slot_of[i], lens[i] - 1  # positions 0 .. n - 1 are live
        assert tiled.slot_of[i] == slot
        flat_plain = retiled[:, slot].reshape(L, hkv, -1, d, KT_TILE)
        want = flat_plain.permute(0, 1, 2, 4, 3).reshape(L, hkv, -1, d)[:, :, :n]
        got = tiled.kt[:, slot].permute(0, 1, 2, 4, 3).reshape(L, hkv, -1, d)[:, :, :n]
        assert torch.equal(got, want)
    assert torch.equal(plain.v, tiled.v)
