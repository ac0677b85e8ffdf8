"""The C decode attention kernel against a float32 dense reference: GQA group sizes 1-8, head
dims 16-256, lengths around its 32-key blocks, sliding windows, rows in permuted slots, strided
queries, empty slots; and the cache-off/cache-on backend paths it serves."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.cpu_kernels import CpuKernels, load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the kernel is off")


def reference(q, kt, v, slots, lens, window, scale):
    """``q [R, Hq, D]`` over slot ``slots[r]``'s first ``lens[r]`` keys, float32."""
    r, hq, d = q.shape
    hkv = kt.shape[1]
    out = torch.zeros(r, hq, d)
    for i in range(r):
        n = int(lens[i])
        if n == 0:
            continue
        lo = max(0, n - window) if window else 0
        k = kt[slots[i], :, :, lo:n].float().repeat_interleave(hq // hkv, 0)  # [Hq, D, n']
        vv = v[slots[i], :, lo:n].float().repeat_interleave(hq // hkv, 0)  # [Hq, n', D]
        s = (q[i].float()[:, None, :] @ k).squeeze(1) * scale
        out[i] = (torch.softmax(s, -1)[:, None, :] @ vv).squeeze(1)
    return out


@pytest.mark.parametrize(
    "hkv,group,d", [(3, 3, 64), (1, 8, 64), (2, 5, 64), (4, 1, 16), (2, 7, 128), (1, 2, 256)]
)
@pytest.mark.parametrize("window", [None, 40])
def test_kernel_matches_float32_reference(hkv, group, d, window) -> None:
    torch.manual_seed(hkv * 100 + group * 10 + d)
    num_slots, cap = 6, 96
    lens = torch.tensor([1, 31, 32, 33, 96, 65], dtype=torch.long)
    slots = torch.tensor([5, 0, 3, 1, 2, 4], dtype=torch.long)
    kt = torch.randn(num_slots, hkv, d, cap).to(torch.bfloat16)
    v = torch.randn(num_slots, hkv, cap, d).to(torch.bfloat16)
    # Strided rows, as q sits inside the fused q/k/v projection's output.
    q = torch.randn(len(lens), hkv * group + 2 * hkv, d).to(torch.bfloat16)[:, : hkv * group]
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    scale = d**-0.5
    assert kernels is not None and CpuKernels.supports(hkv * group, hkv, d)
    kernels.decode_attention(q, kt, v, slots, lens, window, scale, out)
    ref = reference(q, kt, v, slots, lens, window, scale)
    # Only the output's bfloat16 rounding differs (scores and softmax stay float32).
    assert torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_empty_row_is_left_untouched_and_threads_agree() -> None:
    torch.manual_seed(0)
    hkv, group, d, cap = 3, 3, 64, 256
    lens = torch.tensor([200, 0, 256, 17] * 8, dtype=torch.long)  # enough work for OpenMP
    slots = torch.arange(len(lens))
    kt = torch.randn(len(lens), hkv, d, cap).to(torch.bfloat16)
    v = torch.randn(len(lens), hkv, cap, d).to(torch.bfloat16)
    q = torch.randn(len(lens), hkv * group, d).to(torch.bfloat16)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
            assert kernels is not None
            outs.append(kernels.decode_attention(q, kt, v, slots, lens, None, 0.125, out))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])  # each (row, head) is one task: no split sums
    assert bool((outs[0][1::4] == 7.0).all())
    ref = reference(q, kt, v, slots, lens, None, 0.125)
    live = lens > 0
    assert torch.allclose(outs[0][live].float(), ref[live], atol=1e-2, rtol=1e-2)


def test_unsupported_shapes_are_refused() -> None:
    assert not CpuKernels.supports(9 * 3, 3, 64)  # 9 query heads per KV head
    assert not CpuKernels.supports(4, 1, 72)  # head_dim not a multiple of 16
    assert not CpuKernels.supports(4, 1, 512)
