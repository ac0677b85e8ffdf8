"""The torch attention backend's decode paths against a dense per-sequence reference, and the
oneDNN-packed projections against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_reference import reference

from splitserve.engine.attention.torch_backend import TorchAttentionBackend
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for
from splitserve.engine.model.layers import Linear, can_pack
from splitserve.engine.step_plan import Product

PAGE = 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,group", [(3, 3), (1, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_rows_match_dense_reference(dtype, hkv, group, window) -> None:
    torch.manual_seed(0)
    d, hq = 16, hkv * group
    prefix = [3, 9, 1, 14]  # cached tokens per sequence; the step adds 1 (or 3 for row 2)
    chunks = [1, 1, 3, 1]  # a mixed batch: one extend row among decodes
    pool = KVPool(KVLayout(1, hkv, d, PAGE, str(dtype).split(".")[1]), 64)
    pages, seqs = [], []
    for n, c in zip(prefix, chunks, strict=True):
        ids = pool.allocator.alloc(pages_for(n + c, PAGE))
        pages.append(ids)
        ks, vs = torch.randn(n + c, hkv, d).to(dtype), torch.randn(n + c, hkv, d).to(dtype)
        seqs.append((ks, vs))
        for p in range(n):
            pool.buffer[ids[p // PAGE], 0, 0, p % PAGE] = ks[p]
            pool.buffer[ids[p // PAGE], 0, 1, p % PAGE] = vs[p]
    for rows in ([0, 1, 3], [0, 1, 2, 3]):  # decode-only, then mixed
        batch = build_forward_batch(
            [[0] * chunks[i] for i in rows], [prefix[i] for i in rows], [pages[i] for i in rows],
            PAGE, [], "cpu",
        )
        k = torch.cat([seqs[i][0][prefix[i] :] for i in rows])
        v = torch.cat([seqs[i][1][prefix[i] :] for i in rows])
        q = torch.randn(k.shape[0], hq, d).to(dtype)
        backend = TorchAttentionBackend()
        out = backend.forward(q, k, v, 0, backend.prepare(batch, pool, window), pool, d**-0.5)
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        t = 0
        for i in rows:
            for j in range(chunks[i]):
                end = prefix[i] + j + 1
                ref = reference(q[t], seqs[i][0][:end], seqs[i][1][:end], window, d**-0.5)
                assert torch.allclose(out[t].float(), ref, atol=tol, rtol=tol), (rows, i, j)
                t += 1


@pytest.mark.skipif(
    not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)), reason="no oneDNN bf16 packing"
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical(bias) -> None:
    torch.manual_seed(0)
    lin = Linear(48, 80, bias, torch.bfloat16)
    lin.weight.data.copy_(torch.randn(80, 48))
    if bias:
        lin.bias.data.copy_(torch.randn(80))
    for rows in (1, 7, 32, 300):
        x = torch.randn(rows, 48).to(torch.bfloat16)
        plain = lin(x, Product.C)  # no C weight (unpacked, then dropped): never the C product
        lin.pack()
        assert lin.packed is not None
        lin.decode_packed = None  # the C decode kernels sum in another order: test_cpu_kernels.py
        assert torch.equal(lin(x, Product.C), plain)
        assert torch.equal(plain, F.linear(x, lin.weight, lin.bias))
        lin.packed = None
