"""What a decode step skips to save time, against the work it replaces: the gather of the scored
rows when a step scores every row in order (``ForwardBatch.logits_every_token``), and the decode
cache's torch-path masks and append indices, built only on first use (``DecodePlan``)."""

from __future__ import annotations

import dataclasses

import torch

from splitserve.engine.attention.decode_attention import decode_bias
from splitserve.engine.attention.decode_kv_cache import DecodeKVCache
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVLayout, KVPool


def _batch(chunks: list[int], prefixes: list[int], sampled: list[int], **kw):
    pages = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(chunks))]
    return build_forward_batch([[7] * n for n in chunks], prefixes, pages, 4, sampled, "cpu", **kw)


def test_logits_every_token_only_when_the_indices_are_every_row_in_order() -> None:
    assert _batch([1, 1, 1], [5, 9, 2], [0, 1, 2]).logits_every_token
    assert not _batch([1, 1, 1], [5, 9, 2], [0, 2]).logits_every_token  # a row not sampled
    assert not _batch([1, 1, 1], [5, 9, 2], [2, 1, 0]).logits_every_token  # out of order
    assert not _batch([3, 1], [0, 9], [0, 1]).logits_every_token  # a prompt chunk
    # Every position of the only sequence scored (prompt logprobs): arange(T) again.
    assert _batch([3], [0], [], all_logit_seq_indices=[0]).logits_every_token
    # A drafted row scored at each of its positions, in order.
    assert _batch([3, 1], [4, 9], [0, 1], logit_counts=[3, 1]).logits_every_token
    for b in (_batch([1, 1, 1], [5, 9, 2], [0, 2]), _batch([3, 1], [0, 9], [0, 1])):
        assert b.logit_indices.tolist() != list(range(b.input_ids.shape[0]))


def test_model_step_without_the_gather_is_bit_identical(model_path) -> None:
    """The default model (bfloat16, the fused C layers where they run): one decode step of 3
    rows scored with and without the skipped gather gives the same logits bit for bit."""
    from splitserve.config import EngineConfig
    from splitserve.engine.model.loader import load_model

    # kernels="c": no start-up timing of the products (the C ones serve 3 rows anyway).
    model, cfg = load_model(model_path, dtype=torch.bfloat16, engine=EngineConfig(kernels="c"))
    pool = KVPool(cfg.kv_layout(16, "bfloat16"), 64)
    pages = [pool.allocator.alloc(2) for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 17, 11)]
    prefill = build_forward_batch(
        prompts, [0, 0, 0], pages, 16, [0, 1, 2], "cpu", seq_ids=[0, 1, 2]
    )
    assert not prefill.logits_every_token
    model(prefill, pool)
    step = build_forward_batch(
        [[11], [12], [13]], [5, 17, 11], pages, 16, [0, 1, 2], "cpu", seq_ids=[0, 1, 2]
    )
    assert step.logits_every_token
    fast = model(step, pool)
    # The same step again (its K/V rewritten with the same values), gathering the rows.
    slow = model(dataclasses.replace(step, logits_every_token=False), pool)
    assert fast.dtype == torch.float32 and fast.shape == (3, cfg.vocab_size)
    assert torch.equal(fast, slow)


def test_decode_plan_builds_the_torch_path_tensors_as_before() -> None:
    """``biases``, ``kt_index`` and ``v_index`` built on first use equal the formulas the plan
    used to evaluate eagerly (the cache's flat layout: ``[slot, head, d, pos]`` for keys)."""
    layout = KVLayout(2, 2, 16, 4, "bfloat16")
    pool = KVPool(layout, 32)
    cache = DecodeKVCache(pool, max_bytes=1 << 30)
    pages = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    first = cache.plan([10, 11, 12], [5, 9, 3], pages, None)  # slots 0, 1, 2
    assert first is not None
    cache.append_all_targets(first)  # the step's appends done (else the next plan clears)
    plan = cache.plan([12, 10], [4, 6], pages[[2, 0]], [None, 3])  # 11 leaves: slot 1 free
    assert plan is not None and plan._biases is None and plan._kt_index is None
    assert plan.slots.tolist() == [2, 0] and plan.num_slots == 3 and not plan.is_identity
    assert plan.lens.tolist() == [4, 6] and plan.positions.tolist() == [3, 5]
    cap, hkv, d = plan.num_keys, 2, 16
    kt_index = [
        ((s * hkv + h) * d + e) * cap + p
        for s, p in ((2, 3), (0, 5))
        for h in range(hkv)
        for e in range(d)
    ]
    v_index = [(s * hkv + h) * cap + p for s, p in ((2, 3), (0, 5)) for h in range(hkv)]
    assert plan.kt_index.tolist() == kt_index
    assert plan.v_index.tolist() == v_index
    assert set(plan.biases) == {None, 3}
    for w in (None, 3):
        want = decode_bias([6, 0, 4], cap, hkv, w, torch.bfloat16, "cpu")
        assert torch.equal(plan.biases[w], want)
