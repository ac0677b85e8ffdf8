"""The C extend (prefill) attention kernel against a float32 reference: GQA group sizes, head
dims 16-256, prefixes and lengths around its 32-key blocks and page edges, pages in shuffled
order with NaN in every unused pool slot, strided queries, sliding windows. Also: a row's bits do
not depend on the prefix split or chunking (radix cache on = off), 1 vs 2 threads agree, and the
torch backend takes the kernel for bfloat16 extends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.attention.torch_backend import TorchAttentionBackend
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for
from tests.cpu_kernels import BF16_KERNEL_FLAGS, load_or_fail, require_kernel

kernels = load_or_fail()
probe = torch.zeros(1, 1, 2, 16, 1, 16, dtype=torch.bfloat16)  # one page of one layer
has_kernel = kernels is not None and (
    kernels.extend_attention(torch.zeros(1, 1, 16, dtype=torch.bfloat16), probe, 0,
                             torch.zeros(1, dtype=torch.long), 1, None, 1.0) is not None
)
pytestmark = require_kernel(kernels, has_kernel, BF16_KERNEL_FLAGS,
                            "extend attention (extend_attention.c)")


def paged(ks: torch.Tensor, vs: torch.Tensor, ps: int, layers: int = 2, layer: int = 1):
    """``ks/vs [S, Hkv, D]`` written into a NaN-filled pool in shuffled pages -> (buffer, pages)."""
    s, hkv, d = ks.shape
    n = pages_for(s, ps)
    buf = torch.full((n + 3, layers, 2, ps, hkv, d), float("nan"), dtype=torch.bfloat16)
    pages = torch.randperm(n + 3)[:n]
    for j in range(s):
        buf[pages[j // ps], layer, 0, j % ps] = ks[j]
        buf[pages[j // ps], layer, 1, j % ps] = vs[j]
    return buf, pages


def reference(q, ks, vs, window, scale):
    """``q [n, Hq, D]``, the last n of ``ks/vs [S, Hkv, D]``'s positions, causal, float32."""
    n, s = q.shape[0], ks.shape[0]
    qpos = torch.arange(s - n, s)[:, None]
    kpos = torch.arange(s)[None]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], ks.float().transpose(0, 1)[None],
        vs.float().transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize(
    "hkv,group,d", [(3, 3, 64), (1, 8, 64), (2, 5, 16), (4, 1, 128), (1, 2, 256), (1, 12, 80)]
)
@pytest.mark.parametrize(
    "n,prefix,ps,window",
    [(1, 0, 16, None), (31, 0, 16, None), (33, 31, 16, None), (100, 64, 8, None),
     (7, 129, 16, None), (70, 60, 16, 50), (40, 3, 4, 7)],
)
def test_kernel_matches_float32_reference(hkv, group, d, n, prefix, ps, window) -> None:
    torch.manual_seed(n * 1000 + prefix + d)
    s = prefix + n
    ks, vs = torch.randn(s, hkv, d).bfloat16(), torch.randn(s, hkv, d).bfloat16()
    buf, pages = paged(ks, vs, ps)
    # Strided tokens, as q sits inside the fused q/k/v projection's output.
    q = torch.randn(n, hkv * group * d + 24).bfloat16()[:, 8 : 8 + hkv * group * d]
    q = q.view(n, hkv * group, d)
    assert kernels is not None
    out = kernels.extend_attention(q, buf, 1, pages, s, window, d**-0.5)
    assert out is not None and torch.isfinite(out.float()).all()
    ref = reference(q, ks, vs, window, d**-0.5)
    # Exact bfloat16 products and float32 sums; the probabilities are rounded to bfloat16 for
    # the value product (as torch's CPU flash kernel does), and the output once.
    assert torch.allclose(out.float(), ref, atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.parametrize("window", [None, 45])
def test_rows_do_not_depend_on_prefix_split_chunks_or_threads(window) -> None:
    """The same token's output, bit for bit, whether computed in one prefill, after a cached
    prefix (radix cache on), in chunks (chunked prefill), or on 1 or 2 threads."""
    torch.manual_seed(3)
    s, hkv, group, d = 150, 3, 3, 64
    ks, vs = torch.randn(s, hkv, d).bfloat16(), torch.randn(s, hkv, d).bfloat16()
    q = torch.randn(s, hkv * group, d).bfloat16()
    buf, pages = paged(ks, vs, 16)
    assert kernels is not None
    whole = kernels.extend_attention(q, buf, 1, pages, s, window, 0.125)
    assert whole is not None
    for prefix in (1, 31, 32, 77, 149):
        part = kernels.extend_attention(q[prefix:], buf, 1, pages, s, window, 0.125)
        assert part is not None and torch.equal(part, whole[prefix:]), prefix
    for chunk in (37, 64):
        for start in range(0, s, chunk):
            end = min(s, start + chunk)
            part = kernels.extend_attention(q[start:end], buf, 1, pages, end, window, 0.125)
            assert part is not None and torch.equal(part, whole[start:end]), (chunk, start)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            again = kernels.extend_attention(q, buf, 1, pages, s, window, 0.125)
            assert again is not None and torch.equal(again, whole), t
    finally:
        torch.set_num_threads(threads)


def test_unsupported_head_dims_are_declined() -> None:
    assert kernels is not None
    for d in (8, 72, 272):
        buf = torch.zeros(1, 1, 2, 16, 1, d, dtype=torch.bfloat16)
        q = torch.zeros(2, 1, d, dtype=torch.bfloat16)
        assert kernels.extend_attention(q, buf, 0, torch.zeros(1, dtype=torch.long), 2, None, 1.0) is None


def test_backend_takes_the_kernel_for_bfloat16_extends() -> None:
    """A mixed batch (two prefills, one with a cached prefix, and a decode row) through the
    torch backend: the kernel serves the extends and agrees with the SDPA path it replaces."""
    torch.manual_seed(5)
    hkv, group, d, ps = 3, 3, 64, 16
    prefix, chunks = [0, 40, 9], [50, 20, 1]
    pool = KVPool(KVLayout(1, hkv, d, ps, "bfloat16"), 32)
    pages, seqs = [], []
    for n, c in zip(prefix, chunks, strict=True):
        ids = pool.allocator.alloc(pages_for(n + c, ps))
        pages.append(ids)
        ks, vs = torch.randn(n + c, hkv, d).bfloat16(), torch.randn(n + c, hkv, d).bfloat16()
        seqs.append((ks, vs))
        for p in range(n):
            pool.buffer[ids[p // ps], 0, 0, p % ps] = ks[p]
            pool.buffer[ids[p // ps], 0, 1, p % ps] = vs[p]
    batch = build_forward_batch([[0] * c for c in chunks], prefix, pages, ps, [], "cpu")
    k = torch.cat([ks[n:] for (ks, _), n in zip(seqs, prefix, strict=True)])
    v = torch.cat([vs[n:] for (_, vs), n in zip(seqs, prefix, strict=True)])
    q = torch.randn(k.shape[0], hkv * group, d).bfloat16()
    calls = []
    backend = TorchAttentionBackend()
    meta = backend.prepare(batch, pool, None)
    kern = backend.kernels_for(pool, hkv * group)
    assert kern is not None
    original = kern.extend_attention

    def counted(*args, **kwargs):
        calls.append(args[4])  # seq_len
        return original(*args, **kwargs)

    kern.extend_attention = counted  # type: ignore[method-assign]
    try:
        out = backend.forward(q, k, v, 0, meta, pool, d**-0.5)
    finally:
        del kern.extend_attention
    assert calls == [50, 60]
    sdpa = TorchAttentionBackend()
    sdpa.kernels, sdpa._kernels_checked = None, True  # torch ops only
    expected = sdpa.forward(q, k, v, 0, sdpa.prepare(batch, pool, None), pool, d**-0.5)
    assert torch.allclose(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    t = 0
    for (ks, vs), n, c in zip(seqs, prefix, chunks, strict=True):
        ref = reference(q[t : t + c], ks[: n + c], vs[: n + c], None, d**-0.5)
        assert torch.allclose(out[t : t + c].float(), ref, atol=1.5e-2, rtol=1.5e-2)
        t += c
