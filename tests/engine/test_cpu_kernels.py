"""The C kernels against float32 references. Decode attention: GQA group sizes 1-8, head dims
16-256, lengths around its 32-key blocks, sliding windows, rows in permuted slots, strided
queries, empty slots, 1 vs 2 threads. Skinny products: 1-3 rows, odd K, bias, strided rows.
AVX512_BF16 tiles: 3-128 rows, every tile shape, N and row tails, odd K, bias, 1 vs 2 threads.
``Linear`` choosing them only for decode-sized steps."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kernels.cpu.bindings import (
    GEMM_MAX_ROWS,
    KT_TILE,
    SKINNY_MAX_ROWS,
    CpuKernels,
)
from splitserve.engine.model.layers import Linear, can_pack
from splitserve.engine.step_plan import product_for
from tests.cpu_kernels import (
    AMX_KERNEL_FLAGS,
    BF16_KERNEL_FLAGS,
    cpu_flags,
    load_or_fail,
    require_kernel,
)

kernels = load_or_fail()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the kernel is off")


def tiles(kt: torch.Tensor) -> torch.Tensor:
    """Keys ``[slots, Hkv, D, cap]`` in the kernel's layout ``[slots, Hkv, cap / KT_TILE, D,
    KT_TILE]``, built by plain reshaping (independent of the C and cache code)."""
    s, h, d, cap = kt.shape
    return kt.view(s, h, d, cap // KT_TILE, KT_TILE).permute(0, 1, 3, 2, 4).contiguous()


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
    kernels.decode_attention(q, tiles(kt), v, slots, lens, window, scale, out)
    ref = reference(q, kt, v, slots, lens, window, scale)
    # Only the output's bfloat16 rounding differs (exact bfloat16 products, float32 sums).
    assert torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("window", [None, 20])
def test_positions_past_a_rows_length_never_reach_its_output(window) -> None:
    """The last partial block of 32 keys is read whole (its tile): NaN there (stale or
    never-written cache memory) must not leak into the output."""
    torch.manual_seed(7)
    hkv, group, d, cap = 3, 3, 64, 128
    lens = torch.tensor([1, 5, 33, 70, 100], dtype=torch.long)
    slots = torch.arange(len(lens))
    kt = torch.randn(len(lens), hkv, d, cap).to(torch.bfloat16)
    v = torch.randn(len(lens), hkv, cap, d).to(torch.bfloat16)
    for i, n in enumerate(lens.tolist()):
        kt[i, :, :, n:] = float("nan")
        v[i, :, n:] = float("nan")
    q = torch.randn(len(lens), hkv * group, d).to(torch.bfloat16)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    assert kernels is not None
    kernels.decode_attention(q, tiles(kt), v, slots, lens, window, d**-0.5, out)
    assert torch.isfinite(out.float()).all()
    ref = reference(q, kt, v, slots, lens, window, d**-0.5)
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
            outs.append(kernels.decode_attention(q, tiles(kt), v, slots, lens, None, 0.125, out))
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


@pytest.mark.parametrize("n,k", [(16, 48), (80, 37), (960, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_float32_reference(n, k, bias) -> None:
    torch.manual_seed(n + k)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    packed = CpuKernels.pack_decode(w)
    assert kernels is not None
    # Up to the skinny limit, then the row groups of four (and their tails) that serve every
    # decode step on CPUs without the AVX512_BF16 tiles.
    for rows in [*range(1, SKINNY_MAX_ROWS + 1), 4, 5, 7, 8, 13, 32, 67]:
        x = torch.randn(rows, k + 5).to(torch.bfloat16)[:, 3 : 3 + k]  # strided rows
        out = kernels.linear_skinny(x, packed, b)
        ref = x.float() @ w.float().T + (0 if b is None else b.float())
        # One bfloat16 rounding of a float32 sum: within 2^-8 relative, plus summation order.
        assert torch.allclose(out.float(), ref, rtol=2**-8, atol=1e-3 * k**0.5), rows


def tile_tolerance(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Allowed ``|out - ref|`` for a float32 sum rounded once to bfloat16 against the float32
    reference ``ref``: half a bfloat16 ulp (at most ``2^-8 |ref|``, slack for a rounding
    boundary) plus a float32 reordering bound (``K * 2^-24`` of the sum of ``|x_k w_k|``)."""
    k = x.shape[1]
    return 2**-8 * ref.abs() + k * 2**-24 * (x.float().abs() @ w.float().abs().T) + 1e-30


@require_kernel(kernels, kernels is not None and kernels.has_gemm, BF16_KERNEL_FLAGS,
                "bfloat16 register tiles (gemm_bf16.c)")
@pytest.mark.parametrize("n,k", [(16, 48), (80, 37), (960, 576), (576, 1536), (4112, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_tiles_match_float32_reference(n, k, bias) -> None:
    torch.manual_seed(n * 7 + k)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    packed = CpuKernels.pack_decode(w)
    assert kernels is not None
    before = torch.get_num_threads()
    try:
        for rows in (3, 4, 5, 8, 13, 32, 64, 127):
            x = torch.randn(rows, k + 5).to(torch.bfloat16)[:, 3 : 3 + k]  # strided rows
            ref = x.float() @ w.float().T + (0 if b is None else b.float())
            tol = tile_tolerance(x, w, ref)
            outs = []
            for blocking in range(4):  # 8x3, 4x6, 6x4, 12x2 tiles
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    out = kernels.linear_gemm(x, packed, b, blocking)
                    assert out is not None
                    assert bool(((out.float() - ref).abs() <= tol).all()), (rows, blocking)
                    outs.append(out)
            # Each output is one thread's one sum in K order: the same bits at any thread count.
            assert all(torch.equal(o, outs[0]) for o in outs)
    finally:
        torch.set_num_threads(before)


@require_kernel(kernels, kernels is not None and kernels.has_amx, AMX_KERNEL_FLAGS,
                "AMX bfloat16 tiles (gemm_amx.c)")
@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (960, 576), (576, 1536), (4112, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_tiles_match_float32_reference(n, k, bias) -> None:
    """``gemm_amx.c`` on ``gemm_bf16.c``'s packed weight: every row count that fills one or
    two row tiles, or leaves a tail (1-16, 17-32, 33+), an odd count of column blocks (its
    last pair has one), strided rows; within one bfloat16 rounding of the float32 reference,
    the same bits at 1 and 2 threads, and the decode product (``decode_linear_bf16``, which
    the fused layers call too) is this kernel wherever it runs."""
    torch.manual_seed(n * 5 + k)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    packed = CpuKernels.pack_decode(w)
    assert kernels is not None
    before = torch.get_num_threads()
    try:
        for rows in (1, 2, 3, 15, 16, 17, 31, 32, 33, 48, 64, 100, 128):
            x = torch.randn(rows, k + 5).to(torch.bfloat16)[:, 3 : 3 + k]  # strided rows
            ref = x.float() @ w.float().T + (0 if b is None else b.float())
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = kernels.linear_amx(x, packed, b)
                assert out is not None
                assert bool(((out.float() - ref).abs() <= tile_tolerance(x, w, ref)).all()), rows
                outs.append(out)
            assert torch.equal(outs[0], outs[1])
            assert torch.equal(kernels.linear_decode(x, packed, b), outs[0])
    finally:
        torch.set_num_threads(before)


@require_kernel(kernels, kernels is not None and kernels.has_amx, AMX_KERNEL_FLAGS,
                "AMX bfloat16 tiles (gemm_amx.c)")
def test_amx_refuses_k_not_a_multiple_of_32_and_the_decode_product_falls_back() -> None:
    """K = 37 does not fill an AMX tile row: the kernel refuses it (None) and the decode
    product takes the AVX512_BF16 tiles (from 3 rows) or the skinny stream, bit for bit."""
    w = torch.randn(80, 37).to(torch.bfloat16)
    packed = CpuKernels.pack_decode(w)
    assert kernels is not None
    for rows in (1, 2, 3, 8):
        x = torch.randn(rows, 37).to(torch.bfloat16)
        assert kernels.linear_amx(x, packed, None) is None
        fallback = (kernels.linear_skinny(x, packed, None) if rows <= 2
                    else kernels.linear_gemm(x, packed, None))
        assert torch.equal(kernels.linear_decode(x, packed, None), fallback)


@pytest.mark.skipif(kernels is None or set(BF16_KERNEL_FLAGS) <= cpu_flags(),
                    reason="this CPU has AVX512_BF16 (/proc/cpuinfo)")
def test_gemm_refuses_without_avx512_bf16() -> None:
    w = CpuKernels.pack_decode(torch.randn(16, 8).to(torch.bfloat16))
    assert kernels is not None and kernels.linear_gemm(torch.ones(4, 8).bfloat16(), w, None) is None
    # Without the tiles every decode row count goes through gemv.c's row groups.
    assert kernels.decode_max_rows == GEMM_MAX_ROWS
    x = torch.randn(40, 8).to(torch.bfloat16)
    assert torch.equal(kernels.linear_decode(x, w, None), kernels.linear_skinny(x, w, None))


@pytest.mark.skipif(
    not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)), reason="no oneDNN bf16 packing"
)
def test_linear_uses_the_decode_kernels_only_for_decode_steps() -> None:
    torch.manual_seed(1)
    lin = Linear(64, 96, True, torch.bfloat16)
    lin.weight.data.copy_(torch.randn(96, 64))
    lin.bias.data.copy_(torch.randn(96))
    lin.pack()
    assert lin.decode_packed is not None and lin.packed is not None and kernels is not None
    top = lin.kernels.decode_max_rows  # the tiles' limit until a kernel plan lowers it
    assert top == kernels.decode_max_rows
    for rows in sorted({1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 32, top, top + 1}):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        onednn = torch.nn.functional.linear(x, lin.weight, lin.bias)
        out = lin(x, product_for(rows, top))  # the step planner's choice for the layers
        if rows > top:
            assert torch.equal(out, onednn)
        else:
            assert torch.equal(out, kernels.linear_decode(x, lin.decode_packed, lin.bias))
            assert torch.allclose(out.float(), onednn.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_kv_append_equals_pool_write_and_cache_append(kv_cache_dtype) -> None:
    """The C KV append against ``KVPool.write`` plus ``DecodeKVCache.append``: the same pool
    bytes (an 8-bit pool's values and scales) and decode cache (keys in the C tiles: the C
    offsets against the cache's own index arithmetic), bit for bit."""
    from splitserve.engine.attention.decode_kv_cache import DecodeKVCache
    from splitserve.engine.kv_pool import KVLayout, KVPool

    torch.manual_seed(2)
    layout = KVLayout(3, 2, 16, 4, "bfloat16", kv_cache_dtype)
    pools = [KVPool(layout, 32), KVPool(layout, 32)]
    caches = [DecodeKVCache(p, max_bytes=1 << 30, tiled=True) for p in pools]
    # Three sequences of 5, 9 and 2 tokens already in the pool; the step appends one token each.
    lens = [6, 10, 3]
    pages = [torch.tensor([1, 2]), torch.tensor([3, 4, 5]), torch.tensor([6])]
    table = torch.zeros(3, 3, dtype=torch.long)
    for i, p in enumerate(pages):
        table[i, : len(p)] = p
    if layout.is_quantized:  # random codes (no fp8 NaN: bits 0-2 never all set) and scales
        pools[0].buffer.copy_(torch.randint(0, 256, pools[0].buffer.shape) & 0xFB)
        pools[0].scales.copy_(torch.rand(pools[0].scales.shape) + 0.1)
    else:
        pools[0].buffer.copy_(torch.randn(pools[0].buffer.shape).to(torch.bfloat16))
    pools[1].buffer.copy_(pools[0].buffer)
    plans = [c.plan([7, 3, 9], lens, table, None) for c in caches]
    page_ids = torch.tensor([int(pages[i][(n - 1) // 4]) for i, n in enumerate(lens)])
    offsets = torch.tensor([(n - 1) % 4 for n in lens])
    for layer in range(3):
        qkv = torch.randn(3, 8, 16).to(torch.bfloat16)  # k and v as strided slices
        qkv[0, 5] = 0.0  # a zero vector (scale 1 in an 8-bit pool)
        k, v = qkv[:, 4:6], qkv[:, 6:8]
        pools[0].write(layer, page_ids, offsets, k, v)
        caches[0].append(layer, plans[0], k, v)
        assert kernels is not None
        targets = caches[1].append_targets(layer, plans[1])
        kernels.kv_append(k, v, pools[1], layer, page_ids, offsets, targets)
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    assert torch.equal(caches[0].kt, caches[1].kt) and torch.equal(caches[0].v, caches[1].v)
    assert caches[0]._layers_left == caches[1]._layers_left == 0


def test_norm_rope_silu_round_like_the_torch_ops() -> None:
    """The fused elementwise kernels against the torch code they replace (bfloat16): equal
    except where float32 summation order moves an RMSNorm output across a rounding boundary."""
    import torch.nn.functional as F

    from splitserve.engine.model.layers import RMSNorm
    from splitserve.engine.model.rope import RotaryEmbedding, apply_rope

    assert kernels is not None
    torch.manual_seed(3)
    for t in (1, 5, 200):  # 200 rows: the OpenMP split
        x, r = (torch.randn(2, t, 576) * 3).to(torch.bfloat16)
        norm = RMSNorm(576, 1e-5, torch.bfloat16)
        norm.weight.data.copy_(torch.randn(576))
        out, res = kernels.rms_norm(x, norm.weight, 1e-5, r)
        assert torch.equal(res, r + x)
        assert (out != norm(r + x)).float().mean() < 1e-3
        rope = RotaryEmbedding(64, 100000.0, None, 512)
        pos = torch.randint(0, 512, (t,))
        qkv = torch.randn(t, 15, 64).to(torch.bfloat16)
        cos, sin = rope.cos_sin(pos, torch.bfloat16)
        ref = apply_rope(qkv[:, :12], cos, sin)
        kernels.rope_(qkv[:, :12], pos, rope.cos, rope.sin)
        assert torch.equal(qkv[:, :12], ref)
        for n in (96, 101):  # 101: the AVX2 loop's 8-lane blocks and a scalar tail
            gate_up = (torch.randn(t, 2 * n) * 4).to(torch.bfloat16)
            gate, up = gate_up.split(n, dim=-1)
            assert torch.equal(kernels.silu_mul(gate_up), F.silu(gate) * up)


def test_greedy_kernel_equals_argmax_and_log_softmax() -> None:
    assert kernels is not None
    torch.manual_seed(4)
    logits = torch.randn(5, 49152) * 6
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins
    logits[1, :100] = float("-inf")  # a grammar-masked row
    out = kernels.greedy(logits)
    assert out is not None
    ids, logprobs = out
    assert torch.equal(ids, logits.argmax(-1)) and int(ids[0]) == 7
    ref = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(logprobs, ref, atol=1e-5, rtol=1e-5)
    logits[2, 3] = float("nan")
    assert kernels.greedy(logits) is None  # the sampler keeps torch's NaN semantics


def test_without_onednn_packing_every_row_count_takes_the_c_product(monkeypatch) -> None:
    """Where oneDNN packs no bfloat16 weight (AVX2-only CPUs; forced here), a projection's
    products at any row count, prefill included, go to the C kernel on its packed copy (torch's
    emulated bfloat16 product is 5-7x slower there), and an empty step stays empty."""
    from splitserve.engine.model import layers
    from splitserve.engine.step_plan import Product

    if kernels is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(layers, "onednn_packs_bf16", lambda: False)
    torch.manual_seed(3)
    lin = Linear(64, 96, True, torch.bfloat16)
    lin.weight.data.copy_(torch.randn(96, 64))
    lin.bias.data.copy_(torch.randn(96))
    lin.pack()
    assert lin.packed is None and lin.decode_packed is not None
    for rows in (0, 1, 5, 200):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        out = lin(x, Product.TORCH)
        assert out.shape == (rows, 96)
        if rows:
            assert torch.equal(out, kernels.linear_decode(x, lin.decode_packed, lin.bias))
            ref = x.float() @ lin.weight.float().T + lin.bias.float()
            assert torch.allclose(out.float(), ref, rtol=2**-7, atol=1e-2)


def test_without_onednn_packing_int8_prompt_steps_take_the_int8_product(monkeypatch) -> None:
    """The same for int8 weights (``--quantization int8``) and the LM head: a prompt step's
    products, at any row count, go to the int8 C product (``gemm_w8.c``), not ``F.linear`` on
    the de-quantized bfloat16 weight (torch's emulated bfloat16 on AVX2: a c=32 run's TTFT was
    26 s against 3.8 s in bfloat16)."""
    from splitserve.engine.model import layers
    from splitserve.engine.model.layers import LMHead
    from splitserve.engine.step_plan import Product

    if kernels is None or not kernels.has_w8:
        pytest.skip("no int8 C product on this CPU")
    monkeypatch.setattr(layers, "onednn_packs_bf16", lambda: False)
    torch.manual_seed(5)
    lin = Linear(64, 96, True, torch.bfloat16)
    lin.weight.data.copy_(torch.randn(96, 64))
    lin.bias.data.copy_(torch.randn(96))
    lin.quantize_int8()
    lin.pack()
    head = LMHead(torch.randn(160, 64).to(torch.bfloat16))
    head.quantize_int8()
    head.pack()
    assert lin.packed is None and lin.int8 is not None and lin.kernels is not None
    assert head.packed is None and head.int8 is not None and head.kernels is not None
    for rows in (1, 5, 200):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        got = lin(x, Product.TORCH)
        assert torch.equal(got, kernels.linear_w8(x, lin.int8.packed, lin.int8.scales, lin.bias))
        logits = head(x, Product.TORCH)
        want = kernels.linear_w8(x, head.int8.packed, head.int8.scales, None).float()
        assert logits.dtype == torch.float32 and torch.equal(logits, want)
