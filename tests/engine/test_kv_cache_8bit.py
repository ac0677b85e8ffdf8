"""The 8-bit KV pool (``--kv-cache-dtype int8|fp8_e4m3``): the round-trip bound, the page
layout (scales inside each page), the torch attention paths over it against a dense reference
on the de-quantized K/V, and the config's refusals."""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference

from splitserve.config import EngineConfig
from splitserve.engine.attention.torch_backend import TorchAttentionBackend
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for
from splitserve.engine.kv_quant import dequantize_kv, quantize_kv

PAGE = 4
KINDS = ["int8", "fp8_e4m3"]


def _bound(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The module docstring's per-element bound on ``|x - round_trip(x)|``."""
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":
        return amax / 254 * (1 + 1e-5)
    scale = amax / 448
    return torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_within_bound(kind) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 3, 64) * torch.logspace(-3, 2, 64)[:, None, None]
    x[5, 1] = 0.0  # an all-zero vector: scale 1, exact zeros back
    x[7, 2, 11] = 300.0  # an outlier sets its vector's scale
    q, scale = quantize_kv(x, kind)
    assert q.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    assert scale.shape == (64, 3) and scale.dtype == torch.float32
    back = dequantize_kv(q, scale, torch.float32)
    err = (back - x).abs()
    assert (err <= _bound(x, kind)).all(), (err - _bound(x, kind)).max()
    assert torch.equal(back[5, 1], torch.zeros(64))
    assert back[7, 2, 11] == pytest.approx(300.0, rel=1e-6)  # amax is exact in both formats
    rel = (err.norm() / x.norm()).item()
    assert rel < (0.01 if kind == "int8" else 0.04), rel


def test_bytes_per_token_halves() -> None:
    """SmolLM2's geometry: bfloat16 23,040 bytes per token, 8-bit 12,240 (values + scales)."""
    bf16 = KVLayout(30, 3, 64, 16, "bfloat16")
    for kind in KINDS:
        q8 = KVLayout(30, 3, 64, 16, "bfloat16", kind)
        assert bf16.bytes_per_token == 30 * 2 * 3 * 64 * 2 == 23040
        assert q8.bytes_per_token == 30 * 2 * 3 * (64 + 4) == 12240
        pool = KVPool(q8, 8)
        assert pool.buffer.shape == (8, q8.page_bytes) and pool.buffer.is_contiguous()


@pytest.mark.parametrize("kind", KINDS)
def test_scales_travel_inside_pages(kind) -> None:
    """Whole pages copied as raw rows (what every transfer backend does) carry the scales: the
    copy reads back bit for bit; without the scale bytes it does not."""
    torch.manual_seed(1)
    layout = KVLayout(2, 3, 16, PAGE, "bfloat16", kind)
    a, b = KVPool(layout, 6), KVPool(layout, 6)
    ids = torch.tensor([1, 1, 1, 2, 2, 3])
    offs = torch.tensor([0, 1, 3, 0, 2, 1])
    for layer in range(2):
        a.write(layer, ids, offs, 5 * torch.randn(6, 3, 16), torch.randn(6, 3, 16))
    b.write_pages([4, 5, 1], a.read_pages([1, 2, 3]))
    for layer in range(2):
        for kv in (0, 1):
            got = b.gather(layer, kv, torch.tensor([4, 5, 1]), torch.bfloat16)
            assert torch.equal(got, a.gather(layer, kv, torch.tensor([1, 2, 3]), torch.bfloat16))
    assert torch.equal(b.scales[[4, 5, 1]], a.scales[[1, 2, 3]])
    b.buffer[4, layout.value_bytes :] = 0  # the scale bytes of one page, dropped
    assert not torch.equal(b.gather(0, 0, torch.tensor([4]), torch.float32),
                           a.gather(0, 0, torch.tensor([1]), torch.float32))
    with pytest.raises(TypeError, match="de-quantized through KVPool.gather"):
        a.k_pages(0)


def _filled_pool(kind: str, dtype: torch.dtype, hkv: int, d: int, prefix, chunks):
    """A pool holding each sequence's prefix K/V, and the full K/V per sequence."""
    pool = KVPool(KVLayout(1, hkv, d, PAGE, str(dtype).split(".")[1], kind), 64)
    pages, seqs = [], []
    for n, c in zip(prefix, chunks, strict=True):
        ids = pool.allocator.alloc(pages_for(n + c + 1, PAGE))  # room for a second step
        pages.append(ids)
        ks, vs = torch.randn(n + c, hkv, d).to(dtype), torch.randn(n + c, hkv, d).to(dtype)
        seqs.append((ks, vs))
        pos = torch.arange(n)
        page_of = torch.tensor(ids, dtype=torch.long)[pos // PAGE]
        pool.write(0, page_of, pos % PAGE, ks[:n], vs[:n])
    return pool, pages, seqs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_cache", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_over_8bit_pool(kind, dtype, decode_cache, window) -> None:
    """Decode rows (SDPA in float32; head-major gather or the decode KV cache in bfloat16),
    a prompt chunk over a cached prefix (chunked prefill) and a whole new prompt, against dense
    float32 attention over the de-quantized K/V. Two steps, so the decode cache's rows are
    appended to in the second; and, so that the check can fail, the same with every scale
    dropped to 1 is far off."""
    torch.manual_seed(0)
    hkv, group, d = 3, 3, 16
    hq = hkv * group
    prefix, chunks = [3, 9, 1, 14, 0], [1, 1, 3, 1, 6]
    pool, pages, seqs = _filled_pool(kind, dtype, hkv, d, prefix, chunks)
    backend = TorchAttentionBackend(use_decode_cache=decode_cache)
    for step, rows in enumerate(([0, 1, 3], [0, 1, 2, 3, 4])):  # decode-only, then mixed
        seq_ids = rows if decode_cache else None
        if step == 1:  # the decode rows' second token
            prefix = [n + (1 if i in (0, 1, 3) else 0) for i, n in enumerate(prefix)]
        batch = build_forward_batch(
            [[0] * chunks[i] for i in rows], [prefix[i] for i in rows], [pages[i] for i in rows],
            PAGE, [], "cpu", seq_ids=seq_ids,
        )
        if step == 1:
            for i in (0, 1, 3):  # one more position each, written by the last step
                seqs[i] = tuple(torch.cat([t, torch.randn(1, hkv, d).to(dtype)]) for t in seqs[i])
        k = torch.cat([seqs[i][0][prefix[i] : prefix[i] + chunks[i]] for i in rows])
        v = torch.cat([seqs[i][1][prefix[i] : prefix[i] + chunks[i]] for i in rows])
        q = torch.randn(k.shape[0], hq, d).to(dtype)
        out = backend.forward(q, k, v, 0, backend.prepare(batch, pool, window), pool, d**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        t = 0
        for i in rows:
            ks, vs = (pool.round_trip(x) for x in seqs[i])  # what the pool holds
            for j in range(chunks[i]):
                end = prefix[i] + j + 1
                ref = reference(q[t], ks[:end], vs[:end], window, d**-0.5)
                assert torch.allclose(out[t].float(), ref, atol=tol, rtol=tol), (step, i, j)
                t += 1
    assert pool.scales is not None
    pool.scales.fill_(1.0)  # scales dropped: the stored 8-bit values read as they are
    broken = TorchAttentionBackend(use_decode_cache=False)
    batch = build_forward_batch([[0]], [prefix[1]], [pages[1]], PAGE, [], "cpu")
    q = torch.randn(1, hq, d).to(dtype)
    k, v = seqs[1][0][prefix[1] : prefix[1] + 1], seqs[1][1][prefix[1] : prefix[1] + 1]
    out = broken.forward(q, k, v, 0, broken.prepare(batch, pool, window), pool, d**-0.5)
    ks, vs = (pool.round_trip(x) for x in seqs[1])
    ref = reference(q[0], ks[: prefix[1] + 1], vs[: prefix[1] + 1], window, d**-0.5)
    assert not torch.allclose(out[0].float(), ref, atol=0.1, rtol=0.1)


def test_8bit_attention_close_to_unquantized() -> None:
    """Quality at the attention output: one decode row over 200 keys, int8 and fp8 pools
    against the same K/V in a float32 pool. Random K/V make near-uniform attention, whose small
    output (an average of 200 values) is the worst case for relative error: measured 1.4%
    (int8) and 6.9% (fp8_e4m3); the bounds are about twice that."""
    torch.manual_seed(2)
    hkv, hq, d, n = 3, 9, 64, 200
    ks, vs = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    q = torch.randn(1, hq, d) * 2
    outs = {}
    for kind in ("auto", *KINDS):
        pool = KVPool(KVLayout(1, hkv, d, 16, "float32", kind), 32)
        ids = pool.allocator.alloc(pages_for(n, 16))
        pos = torch.arange(n - 1)
        pool.write(0, torch.tensor(ids)[pos // 16], pos % 16, ks[:-1], vs[:-1])
        batch = build_forward_batch([[0]], [n - 1], [ids], 16, [], "cpu")
        be = TorchAttentionBackend()
        outs[kind] = be.forward(q, ks[-1:], vs[-1:], 0, be.prepare(batch, pool, None), pool,
                                d**-0.5)
    for kind, bound in (("int8", 0.03), ("fp8_e4m3", 0.14)):
        rel = ((outs[kind] - outs["auto"]).norm() / outs["auto"].norm()).item()
        assert 0 < rel < bound, (kind, rel)


def test_config_takes_8bit_kv_on_every_backend() -> None:
    EngineConfig(kv_cache_dtype="int8").check()
    EngineConfig(kv_cache_dtype="fp8_e4m3", device="cuda", attention="torch").check()
    for fields in ({"device": "cuda"}, {"attention": "triton"}):  # the Triton kernels read it
        EngineConfig(kv_cache_dtype="int8", **fields).check()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4").check()


def test_layout_mismatch_names_kv_dtype() -> None:
    a = KVLayout(30, 3, 64, 16, "bfloat16", "int8")
    msg = a.mismatch(KVLayout(30, 3, 64, 16, "bfloat16"))
    assert msg == "KV layout mismatch (kv_cache_dtype: int8 here vs auto on the peer)"
