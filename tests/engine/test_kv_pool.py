"""Page allocator, KV pool page I/O and ForwardBatch construction (CPU, no model)."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVLayout, KVPool, PageAllocator, pages_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")


def test_alloc_free_and_counts() -> None:
    alloc = PageAllocator(5)
    assert alloc.num_free == 4 and alloc.num_used == 0
    pages = alloc.alloc(3)
    assert len(set(pages)) == 3 and 0 not in pages
    assert alloc.num_free == 1 and alloc.num_used == 3
    alloc.free(pages[:2])
    assert alloc.num_free == 3
    again = alloc.alloc(3)
    assert 0 not in again and not set(again) & {pages[2]}


def test_exhaustion_and_can_alloc() -> None:
    alloc = PageAllocator(4)
    assert alloc.can_alloc(3) and not alloc.can_alloc(4)
    alloc.alloc(3)
    assert not alloc.can_alloc(1) and alloc.can_alloc(0)
    with pytest.raises(MemoryError, match="exhausted"):
        alloc.alloc(1)


@pytest.mark.parametrize("bad", [0, -1, 9])
def test_bad_free(bad: int) -> None:
    alloc = PageAllocator(9)
    with pytest.raises(ValueError):
        alloc.free([bad])


def test_double_free() -> None:
    alloc = PageAllocator(4)
    (page,) = alloc.alloc(1)
    alloc.free([page])
    with pytest.raises(ValueError, match="already free"):
        alloc.free([page])


def test_too_small_pool() -> None:
    with pytest.raises(ValueError):
        PageAllocator(1)


def test_layout_mismatch_and_bytes() -> None:
    other = KVLayout(2, 2, 4, 8, "bfloat16")
    assert LAYOUT.mismatch(LAYOUT) is None
    msg = LAYOUT.mismatch(other)
    assert msg is not None and "page_size" in msg and "dtype" in msg and "head_dim" not in msg
    assert LAYOUT.page_bytes == 2 * 2 * 4 * 2 * 4 * 4


def test_read_write_pages_roundtrip() -> None:
    src, dst = KVPool(LAYOUT, 6), KVPool(LAYOUT, 6)
    pages = src.allocator.alloc(2)
    src.buffer[pages] = torch.randn(2, *src.buffer.shape[1:])
    data = src.read_pages(pages)
    assert data.shape == (2, 2, 2, 4, 2, 4)
    targets = dst.allocator.alloc(3)[1:]
    dst.write_pages(targets, data)
    assert torch.equal(dst.read_pages(targets), data)
    assert torch.equal(dst.buffer[0], torch.zeros_like(dst.buffer[0]))  # scratch untouched


def test_write_and_layer_views() -> None:
    pool = KVPool(LAYOUT, 4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    page_ids, offsets = torch.tensor([2, 2, 3]), torch.tensor([1, 2, 0])
    pool.write(1, page_ids, offsets, k, v)
    assert torch.equal(pool.k_pages(1)[page_ids, offsets], k)
    assert torch.equal(pool.v_pages(1)[page_ids, offsets], v)
    assert not pool.k_pages(0).any()


def test_build_forward_batch() -> None:
    # seq 0: prefill of 6 tokens on pages [5, 2]; seq 1: decode of 1 token after 4 cached on [7, 3].
    b = build_forward_batch([[1, 2, 3, 4, 5, 6], [9]], [0, 4], [[5, 2], [7, 3]], 4, [0, 1])
    assert b.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 9]
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 5, 4]
    assert b.extend_lens == [6, 1] and b.seq_lens == [6, 5]
    assert b.out_page_ids.tolist() == [5, 5, 5, 5, 2, 2, 3]
    assert b.out_offsets.tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert b.page_table.tolist() == [[5, 2], [7, 3]]
    assert b.logit_indices.tolist() == [5, 6]
    assert b.batch_size == 2 and not b.is_decode_only
    d = build_forward_batch([[1], [2]], [3, 0], [[4], [6, 8]], 4, [1])
    assert d.is_decode_only and d.page_table.tolist() == [[4, 0], [6, 8]]
    assert d.logit_indices.tolist() == [1]


def test_build_forward_batch_too_few_pages() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        build_forward_batch([[1, 2, 3]], [2], [[1]], 4, [0])


def test_pages_for() -> None:
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_model_fingerprint_tells_models_apart(model_path) -> None:
    """The weights identity the KV handshake compares: stable for one config, different when
    any parsed field differs."""
    import dataclasses

    from splitserve.engine.model.config import ModelConfig

    config = ModelConfig.from_hf(json.loads((model_path / "config.json").read_text()))
    again = ModelConfig.from_hf(json.loads((model_path / "config.json").read_text()))
    assert config.fingerprint() == again.fingerprint()
    assert len(config.fingerprint()) == 16
    for change in ({"num_layers": config.num_layers + 1}, {"rope_theta": config.rope_theta * 2},
                   {"eos_token_ids": [*config.eos_token_ids, 7]}):
        assert dataclasses.replace(config, **change).fingerprint() != config.fingerprint(), change
