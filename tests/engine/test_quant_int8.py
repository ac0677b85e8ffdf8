"""``--quantization int8``: the quantizers (per block of 32 on CPU, per row on CUDA), the
int8 product (AVX512-VNNI, or AVX2 without AVX-512) against the de-quantized
float32 reference within a stated bound, and a float32 int8 model equal to ``transformers``
loaded with the same de-quantized weights (an exact reference: the float32 path computes
``x @ W'.T`` with ``W' = s * Q`` materialized)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.config import EngineConfig
from splitserve.engine.model.quant import (
    Int8Weight,
    dequantize_int8,
    dequantize_int8_groups,
    quantize_int8,
    quantize_int8_groups,
)
from tests.cpu_kernels import (
    AMX_KERNEL_FLAGS,
    VNNI_KERNEL_FLAGS,
    load_or_fail,
    require_kernel,
    w8_kernel_flags,
)

pytestmark = pytest.mark.usefixtures("one_thread")

KERNELS = load_or_fail()
needs_w8 = require_kernel(KERNELS, KERNELS is not None and KERNELS.has_w8, w8_kernel_flags(),
                          "int8 weight products (gemm_w8.c)")


def test_quantize_int8_is_per_channel_absmax_round_to_nearest() -> None:
    w = torch.randn(48, 70, generator=torch.Generator().manual_seed(0))
    w[5] = 0.0  # an all-zero row: scale 1, codes 0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (48,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127  # -128 never used (symmetric)
    assert s[5] == 1.0 and not q[5].any()
    nonzero = torch.arange(48) != 5
    assert torch.equal(q[nonzero].abs().amax(1), torch.full((47,), 127, dtype=torch.int8))
    # Round to nearest: each weight within half a step of its de-quantized value.
    err = (w - dequantize_int8(q, s)).abs()
    assert bool((err <= s[:, None] / 2 * (1 + 1e-6)).all())


def test_quantize_int8_groups_is_absmax_per_row_and_block_of_32() -> None:
    """K = 70: blocks 0-31, 32-63 and a short last one, 64-69; each block's scale is its
    largest |weight| / 127 (that weight's code +-127), an all-zero block's 1."""
    w = torch.randn(16, 70, generator=torch.Generator().manual_seed(0))
    w[3, 32:64] *= 100  # one large block must not coarsen the row's other blocks
    w[7, 64:] = 0.0
    q, s = quantize_int8_groups(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (16, 3)
    for g, (a, b) in enumerate(((0, 32), (32, 64), (64, 70))):
        block = w[:, a:b].abs().amax(1)
        want = torch.where(block > 0, block / 127, torch.ones_like(block))
        assert torch.equal(s[:, g], want)
    assert s[7, 2] == 1.0 and not q[7, 64:].any()
    assert int(q[3, :32].abs().max()) == 127  # its own scale, not the large block's
    err = (w - dequantize_int8_groups(q, s)).abs()
    assert bool((err <= s.repeat_interleave(32, 1)[:, :70] / 2 * (1 + 1e-6)).all())


def w8_error_bound(x: torch.Tensor, w_deq: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """What ``gemm_w8.c`` may differ from ``x @ W'.T`` in float32, per output: x is rounded
    per row and group of 32 to int8 steps of ``max|x_g| / 127`` (half a step each, times
    ``sum_{k in g} |W'[n, k]|``, summed over groups), the output to bfloat16 (2^-9 relative,
    taken as 2^-8), plus float32 sums (1e-5 relative)."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    xf = torch.zeros(m, kp)
    xf[:, :k] = x.float()
    wf = torch.zeros(w_deq.shape[0], kp)
    wf[:, :k] = w_deq
    half_step = xf.abs().reshape(m, -1, 32).amax(2) / 127 / 2  # [m, groups]
    w_group = wf.abs().reshape(wf.shape[0], -1, 32).sum(2)  # [n, groups]
    return half_step @ w_group.T + ref.abs() * (2**-8 + 1e-5) + 1e-6


@needs_w8
@pytest.mark.parametrize(("m", "n", "k", "bias"), [
    (1, 960, 576, False),   # SmolLM2 qkv at batch 1
    (2, 48, 577, True),     # odd K (a zero pad column), N not a multiple of 64 (3-vector tail)
    (11, 16, 1, True),      # one K (a group of 31 zero pads), one 16-column block, 6 + 5 rows
    (1, 48, 1537, False),   # one row, the last group one K and 31 pads
    (13, 576, 1536, False),  # two 6-row tiles and a 1-row tail over 48 groups
    (32, 3072, 576, True),  # SmolLM2 gate_up at batch 32
])
def test_w8_product_within_bound_of_dequantized_reference(m, n, k, bias) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    b = (torch.randn(n, generator=gen)).bfloat16() if bias else None
    q, s = quantize_int8_groups(w)
    w_deq = dequantize_int8_groups(q, s)
    packed = Int8Weight(q, s)
    got = KERNELS.linear_w8(x, packed.packed, packed.scales, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ref = F.linear(x.float(), w_deq, None if b is None else b.float())
    err = (got.float() - ref).abs()
    assert bool((err <= w8_error_bound(x, w_deq, ref)).all()), float(err.max())


@needs_w8
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_w8_sums_are_exact_at_the_largest_codes(sign) -> None:
    """Every x code 127 and every weight code +-127 (U = 255 or 1, the offset by 128 at both
    ends) over K = 1536: each group's int32 sum and the -128 * sum(xq) start are exact, so the
    result is exactly +-K."""
    k = 1536
    w = torch.full((16, k), sign)
    x = torch.ones(1, k, dtype=torch.bfloat16)
    q, s = quantize_int8_groups(w)
    packed = Int8Weight(q, s)
    got = KERNELS.linear_w8(x, packed.packed, packed.scales, None)
    assert torch.equal(got, torch.full((1, 16), sign * k, dtype=torch.bfloat16))


@needs_w8
def test_w8_rows_are_independent_of_the_batch() -> None:
    """Each row's result is the same alone or in a batch (x is quantized per row)."""
    gen = torch.Generator().manual_seed(3)
    q, s = quantize_int8_groups(torch.randn(64, 96, generator=gen))
    packed = Int8Weight(q, s)
    x = torch.randn(9, 96, generator=gen).bfloat16()
    x[4] *= 100  # a row with a large scale must not change the others
    batch = KERNELS.linear_w8(x, packed.packed, packed.scales, None)
    for r in range(9):
        alone = KERNELS.linear_w8(x[r : r + 1], packed.packed, packed.scales, None)
        assert torch.equal(batch[r : r + 1], alone)


def w8_exact_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``gemm_w8.c``'s arithmetic step by step, in torch: x quantized per row and group of 32
    (float32 ``max|x| / 127``, ``x * (1 / scale)`` rounded half to even, clamped to +-127), each
    group's integer sum exact, then per group ``acc = fma(float(sum), s * x_scale, acc)`` in
    float32 (the product exact in float64, the sum rounded once there and then to float32: a
    double rounding that could differ from the fused one in rare ties, deterministically so for
    these fixed inputs), ``acc + bias`` rounded to bfloat16. Every path (VNNI, AMX, AVX2) must
    give exactly these bits. The bfloat16 output hides most float32 ordering (an unfused sum
    gave the same bits here); it does not hide the activation quantization (truncating instead
    of rounding changed every case) or the integer sums."""
    m, k = x.shape
    groups = -(-k // 32)
    xf = torch.zeros(m, groups * 32)
    xf[:, :k] = x.float()
    qw = torch.zeros(q.shape[0], groups * 32, dtype=torch.int64)
    qw[:, :k] = q.long()
    acc = torch.zeros(m, q.shape[0])
    for g in range(groups):
        xg = xf[:, 32 * g : 32 * g + 32]
        amax = xg.abs().amax(1)
        xs = torch.where(amax > 0, amax / torch.tensor(127.0), torch.ones_like(amax))
        xq = torch.round(xg * (torch.tensor(1.0) / xs)[:, None]).clamp(-127, 127).long()
        isum = xq @ qw[:, 32 * g : 32 * g + 32].T  # [m, n], exact
        scale = s[:, g][None, :] * xs[:, None]  # float32 product
        acc = (isum.double() * scale.double() + acc.double()).float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


@needs_w8
@pytest.mark.parametrize(("m", "n", "k", "bias"), [
    (1, 64, 576, False), (3, 48, 577, True), (7, 32, 1537, True), (32, 96, 160, False),
])
def test_w8_bits_equal_the_exact_reference(m, n, k, bias) -> None:
    """The product's bits are those of :func:`w8_exact_reference`, whichever path this CPU
    takes (so the AVX2 path and the VNNI/AMX tiles, never on one machine together, are held
    to the same bits), at row counts of every tile tail, K not a multiple of 32, a bias."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    q, s = quantize_int8_groups(torch.randn(n, k, generator=gen) * 0.05)
    packed = Int8Weight(q, s)
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    x[0, :5] = 0.0
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    got = KERNELS.linear_w8(x, packed.packed, packed.scales, b)
    assert torch.equal(got, w8_exact_reference(x, q, s, b))


@needs_w8
@pytest.mark.parametrize("k", [37, 96, 577])
def test_w8_strided_rows_equal_their_contiguous_copy(k) -> None:
    """Rows x_stride apart (a slice of wider rows, as the fused QKV output's views are) give
    the bits of the same rows made contiguous, with K whole groups or a short last group (the
    quantizer's zero padding must not read the next row's values)."""
    gen = torch.Generator().manual_seed(k)
    q, s = quantize_int8_groups(torch.randn(32, k, generator=gen) * 0.05)
    packed = Int8Weight(q, s)
    wide = (torch.randn(7, k + 40, generator=gen) * 3).bfloat16()
    wide[:, k + 3 :] = 1e4  # values just past each row's K: a leak would show
    x = wide[:, 3 : 3 + k]
    got = KERNELS.linear_w8(x, packed.packed, packed.scales, None)
    assert torch.equal(got, KERNELS.linear_w8(x.contiguous(), packed.packed, packed.scales,
                                              None))


@require_kernel(KERNELS, KERNELS is not None and KERNELS.has_amx and KERNELS.has_w8,
                AMX_KERNEL_FLAGS + VNNI_KERNEL_FLAGS, "AMX-INT8 weight products (gemm_amx.c)")
@pytest.mark.parametrize("n,k", [(48, 96), (3072, 576), (576, 1536), (80, 37)])
def test_w8_on_amx_tiles_has_the_vnni_bits(n, k) -> None:
    """From 16 rows the int8 product runs on AMX-INT8 tiles: the same exact group sums and
    float operations as the VNNI tiles, so the same bits, at row counts that fill one or two
    row tiles or leave a tail, an odd count of column blocks, K not a multiple of 32, strided
    rows, a bias; and every row equals itself computed alone (one row: the VNNI tiles)."""
    gen = torch.Generator().manual_seed(n + k)
    q, s = quantize_int8_groups(torch.randn(n, k, generator=gen) * 0.05)
    packed = Int8Weight(q, s)
    b = torch.randn(n, generator=gen).bfloat16()
    for m in (16, 17, 31, 32, 33, 64, 100):
        x = (torch.randn(m, k + 5, generator=gen) * 3).bfloat16()[:, 2 : 2 + k]
        x[m // 2] *= 100
        amx = KERNELS.linear_w8(x, packed.packed, packed.scales, b)
        vnni = KERNELS.linear_w8(x, packed.packed, packed.scales, b, vnni_only=True)
        assert torch.equal(amx, vnni), m
        for r in (0, m // 2, m - 1):
            alone = KERNELS.linear_w8(x[r : r + 1], packed.packed, packed.scales, b)
            assert torch.equal(amx[r : r + 1], alone), (m, r)


# --- the model: float32 int8 equals transformers with the de-quantized weights --------------


def _dequantized_hf(hf):
    """``hf`` with every projection and the LM head replaced by their int8 de-quantized
    weights (per row and block of 32 of each HF tensor: the same rows as our fused ones); the
    embedding table stays (a tied head is untied)."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in names:
                module.weight.copy_(dequantize_int8_groups(*quantize_int8_groups(module.weight)))
        head = dequantize_int8_groups(*quantize_int8_groups(hf.lm_head.weight))
        hf.lm_head.weight = torch.nn.Parameter(head)  # its own tensor: unties the embedding
    return hf


@pytest.mark.parametrize("tie", [True, False])
def test_float32_int8_model_equals_transformers_on_dequantized_weights(tmp_path, tie) -> None:
    import transformers

    from splitserve.engine.model.loader import load_model
    from tests.engine.test_model_vs_hf import COMMON, Runner, hf_logits, tokens

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": tie,
                                      "attention_bias": True})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    model, our_cfg = load_model(tmp_path, torch.float32,
                                engine=EngineConfig(quantization="int8"))
    ref_hf = _dequantized_hf(hf)
    ids = tokens(14, 5)
    ref = hf_logits(ref_hf, ids)
    run = Runner(model, our_cfg)
    pages = run.pages(14)
    first = run.step([ids[:9]], [0], [pages], all_logits=True)
    torch.testing.assert_close(first, ref[:9], atol=1e-4, rtol=0)
    for pos in range(9, 14):  # decode steps
        torch.testing.assert_close(run.step([[ids[pos]]], [pos], [pages])[0], ref[pos],
                                   atol=1e-4, rtol=0)
    # Quantization changed the model (so the check above is not bf16-vs-itself): the
    # unquantized reference differs by far more than the tolerance.
    assert float((hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), ids)
                  - ref).abs().max()) > 1e-3
