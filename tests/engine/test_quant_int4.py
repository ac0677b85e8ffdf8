"""``--quantization int4``: the quantizer; each product kernel (ours, ``gemm_w4.c``; torch's CPU
int4 kernel; oneDNN on the de-quantized bfloat16 weight) within a stated bound of the same int4
weights de-quantized in float32 (the reference is ``x @ W'.T`` in float64, computed here from
the levels and scales, never by a kernel under test); GGUF Q4_0 tensors keep the file's levels
and scales; a float32 int4 model equals ``transformers`` loaded with the de-quantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitserve.config import EngineConfig
from splitserve.engine.model.layers import Linear, can_pack
from splitserve.engine.model.quant import dequantize_int8_groups, quantize_int8_groups
from splitserve.engine.model.quant_int4 import (
    GROUP,
    Int4Weight,
    dequantize_int4,
    quantize_int4,
    torch_int4_available,
    torch_int4_mm,
    torch_int4_weight,
    unpack_int4,
)
from splitserve.engine.step_plan import product_for
from tests.cpu_kernels import VNNI_KERNEL_FLAGS, load_or_fail, require_kernel

pytestmark = pytest.mark.usefixtures("one_thread")

KERNELS = load_or_fail()
needs_w4 = require_kernel(KERNELS, KERNELS is not None and KERNELS.has_w4, VNNI_KERNEL_FLAGS,
                          "int4 weight products (gemm_w4.c)")
needs_torch_int4 = pytest.mark.skipif(not torch_int4_available(),
                                      reason="this torch has no CPU int4 kernel")
# Decode's row buckets (1-32) and a prompt chunk (64 rows), on the default model's shapes.
SHAPES = [
    (1, 960, 576, True),     # SmolLM2 qkv at batch 1 (Qwen-style bias)
    (2, 48, 96, False),      # N not a multiple of 64: a 3-vector tail block
    (4, 576, 1536, False),   # down_proj
    (7, 16, 32, True),       # one group, one block, a 4-row tile plus a 3-row tail
    (8, 3072, 576, False),   # gate_up
    (16, 576, 576, True),
    (32, 3072, 576, False),
    (64, 576, 1536, False),  # a prompt chunk
]


def test_quantize_int4_is_asymmetric_groupwise_minmax() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=gen) + 0.5  # groups not centred on 0
    w[3, 32:64] = 0.25  # a constant group: scale 1, offset its value, levels 0
    u, s, m = quantize_int4(w)
    assert u.dtype == torch.uint8 and s.dtype == m.dtype == torch.float16
    assert s.shape == m.shape == (32, 4)
    assert int(u.min()) == 0 and int(u.max()) == 15
    assert s[3, 1] == 1.0 and m[3, 1] == 0.25 and not u[3, 32:64].any()
    g = w.reshape(32, 4, GROUP)
    # Every group's minimum is level 0 at its offset; round to nearest within the grid (the
    # top can clip by the float16 rounding of the scale: one step at most).
    assert torch.equal(m, g.amin(-1).half())
    err = (g - dequantize_int4(u, s, m).reshape(32, 4, GROUP)).abs()
    step = s.float()[..., None]
    assert bool((err <= step * (0.5 + 1e-2) + 1e-3).all()), float((err / step).max())
    iw = Int4Weight(u, s, m)
    got = unpack_int4(iw.packed, iw.scales)
    assert all(torch.equal(a, b) for a, b in zip(got, (u, s, m)))


def test_quantize_int4_symmetric_is_q4_0s_grid() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    u, s, m = quantize_int4(w, symmetric=True)
    assert torch.equal(m.float(), -8 * s.float())
    top = w.reshape(16, 2, GROUP).abs().argmax(-1, keepdim=True)
    assert bool((u.reshape(16, 2, GROUP).gather(-1, top) == 0).all())  # largest on level -8


def _case(m, n, k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    x[0, 5] = 40.0  # an outlier: costs precision in its own group only
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    return x, quantize_int4(w), b, w


def _ref(x, w_deq, b) -> torch.Tensor:
    """``x @ W'.T + b`` in float64: the reference, from the levels, scales and offsets alone."""
    return F.linear(x.double(), w_deq.double(), None if b is None else b.double())


def ours_bound(x: torch.Tensor, w_deq: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """What ``gemm_w4.c`` may differ from ``x @ W'.T`` per output: x is rounded per row and
    group of 32 to int8 steps of ``max|x_g| / 127`` (half a step each, times the group's
    ``sum |W'[n, k]|``), the output to bfloat16 (2^-9 relative, taken as 2^-8), plus float32
    sums (1e-5 of ``sum |x| |W'|``)."""
    m, k = x.shape
    xg = x.double().abs().reshape(m, k // GROUP, GROUP)
    half_step = xg.amax(-1) / 127 / 2  # [m, G]
    wg = w_deq.double().abs().reshape(w_deq.shape[0], k // GROUP, GROUP).sum(-1)  # [n, G]
    mag = x.double().abs() @ w_deq.double().abs().t()
    return half_step @ wg.t() + ref.abs() * 2**-8 + mag * 1e-5 + 1e-6


def bf16_weight_bound(x: torch.Tensor, w_deq: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """For a kernel that rounds ``W'`` (or its scales) to bfloat16 (oneDNN on the bfloat16
    parameter; torch's int4 kernel, whose scales are bfloat16): 2^-9 of ``sum |x| |W'|``
    (half a bfloat16 step per weight), plus the output's bfloat16 rounding."""
    mag = x.double().abs() @ w_deq.double().abs().t()
    return mag * 2**-9 + ref.abs() * 2**-8 + 1e-6


def _check(got, ref, bound, x, w_deq, w_orig=None) -> None:
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    # The bound is a real constraint: a few percent of sum |x| |W'| (ours: max|x_g| / 254 per
    # unit of weight, ~3x the mean |x| of Gaussian groups, so ~1.5%) ...
    mag = x.double().abs() @ w_deq.double().abs().t()
    assert float((bound / mag).median()) < 0.03
    # ... and the kernel's error is far below what int4 changed (the unquantized weights, another
    # model, differ from the reference by ~10x more): it computes with W', not the original.
    if w_orig is not None:
        moved = F.linear(x.double(), w_orig.double() - w_deq.double())
        assert float(err.pow(2).mean().sqrt()) < 0.2 * float(moved.pow(2).mean().sqrt())


@needs_w4
@pytest.mark.parametrize(("m", "n", "k", "bias"), SHAPES)
def test_ours_within_bound_of_dequantized_reference(m, n, k, bias) -> None:
    x, usm, b, w = _case(m, n, k, bias, m * n + k)
    w_deq = dequantize_int4(*usm, dtype=torch.float64)
    iw = Int4Weight(*usm)
    got = KERNELS.linear_w4(x, iw.packed, iw.scales, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ref = _ref(x, w_deq, b)
    _check(got, ref, ours_bound(x, w_deq, ref), x, w_deq, w)


@needs_torch_int4
@pytest.mark.parametrize(("m", "n", "k", "bias"), SHAPES)
def test_torch_int4_within_bound_of_its_dequantized_reference(m, n, k, bias) -> None:
    x, usm, b, w = _case(m, n, k, bias, m * n + k)
    iw = Int4Weight(*usm)
    w_deq = torch_int4_weight(*usm)  # its weight: bfloat16 scales and zeros
    ref = _ref(x, w_deq, b)
    _check(torch_int4_mm(x, iw.torch_packed, iw.torch_sz, b), ref,
           bf16_weight_bound(x, w_deq, ref), x, w_deq, w)


@pytest.mark.skipif(not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)),
                    reason="needs oneDNN bf16 packing")
@pytest.mark.parametrize(("m", "n", "k", "bias"), SHAPES[::2])
def test_linear_dispatch_within_bound_for_each_kernel_forced(m, n, k, bias) -> None:
    """A quantized ``Linear``, each of its three paths forced: ours and torch's int4 kernel
    (``Product.C`` and ``C_TORCH_INT4``), oneDNN on the de-quantized bfloat16 weight
    (``Product.TORCH``)."""
    x, _, b, w = _case(m, n, k, bias, 7 * m + n)
    lin = Linear(k, n, bias, torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(b)
    lin.quantize_int4()
    assert lin.int4 is not None
    usm = unpack_int4(lin.int4.packed, lin.int4.scales)
    assert all(torch.equal(a, c) for a, c in zip(usm, quantize_int4(w.bfloat16())))
    lin.pack()
    w_deq = dequantize_int4(*usm, dtype=torch.float64)
    ref = _ref(x, w_deq, b)
    paths = {"onednn": (0, 1 << 30)}
    if lin.kernels is not None:
        paths["ours"] = (128, 1 << 30)
        if lin.int4.torch_packed is not None:
            paths["torch int4"] = (128, 0)
    for name, (c_rows, w4_rows) in paths.items():
        got = lin(x, product_for(x.shape[0], c_rows, w4_rows))  # the step planner's choice
        if name == "torch int4":  # its own weight (bfloat16 scales) is the reference
            w_t = torch_int4_weight(*usm)
            ref_t = _ref(x, w_t, b)
            _check(got, ref_t, bf16_weight_bound(x, w_t, ref_t), x, w_t, w)
            continue
        # oneDNN: the parameter, W' rounded to bfloat16.
        bound = ours_bound(x, w_deq, ref) if name == "ours" else bf16_weight_bound(x, w_deq, ref)
        _check(got, ref, bound, x, w_deq, w)


@needs_w4
def test_ours_rows_are_independent_of_the_batch() -> None:
    """Each row's result is the same alone or in a batch (x is quantized per row and group)."""
    gen = torch.Generator().manual_seed(3)
    iw = Int4Weight(*quantize_int4(torch.randn(64, 96, generator=gen)))
    x = torch.randn(9, 96, generator=gen).bfloat16()
    x[4] *= 100
    batch = KERNELS.linear_w4(x, iw.packed, iw.scales, None)
    for r in range(9):
        assert torch.equal(batch[r : r + 1], KERNELS.linear_w4(x[r : r + 1], iw.packed,
                                                               iw.scales, None))


@needs_w4
def test_ours_exact_at_the_extreme_levels() -> None:
    """Levels 0 and 15 with x at the +127 code over K = 1536: every group's int32 sum (the high
    nibbles' 16x too) and the offset's share are exact (the result is a small integer)."""
    k = 1536
    u = torch.zeros(16, k, dtype=torch.uint8)
    u[:, 1::2] = 15
    s = torch.ones(16, k // GROUP, dtype=torch.float16)
    m = torch.full((16, k // GROUP), -8.0, dtype=torch.float16)  # W' = -8, 7, -8, 7 ...
    iw = Int4Weight(u, s, m)
    x = torch.ones(1, k, dtype=torch.bfloat16)
    got = KERNELS.linear_w4(x, iw.packed, iw.scales, None)
    assert torch.equal(got, torch.full((1, 16), float(-k // 2), dtype=torch.bfloat16))


# --- GGUF Q4_0: the file's own levels and scales ----------------------------------------------


def _q4_0_blocks(gguf_path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 tensor's levels ``q [N, K]`` (0..15) and float16 scales ``[N, K / 32]``, read
    from the file's bytes by the format's definition (18-byte blocks: a float16 scale, then 16
    bytes whose low nibbles are elements 0-15 and high nibbles 16-31)."""
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(str(gguf_path)).tensors if t.name == name)
    k, n = (int(d) for d in t.shape)  # gguf lists the fastest dimension first
    raw = np.asarray(t.data, dtype=np.uint8).reshape(n, k // 32, 18)
    d = raw[..., :2].copy().view(np.float16)[..., 0]
    qs = raw[..., 2:]
    levels = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return torch.from_numpy(levels.reshape(n, k).copy()), torch.from_numpy(d.copy())


def test_gguf_q4_0_keeps_the_files_levels_and_scales(tmp_path) -> None:
    from splitserve.engine.model.loader import load_model
    from tests.engine.test_gguf import _tiny_gguf

    path = _tiny_gguf("qwen3_q4_0", tmp_path)
    model, _ = load_model(path, torch.bfloat16,
                            engine=EngineConfig(quantization="int4", pack_weights=False))
    attn = model.layers[0].self_attn
    q_file, d_file = _q4_0_blocks(path, "blk.0.attn_q.weight")
    rows = q_file.shape[0]
    u_ours, s_ours, m_ours = unpack_int4(attn.qkv_proj.int4.packed, attn.qkv_proj.int4.scales)
    assert torch.equal(u_ours[:rows], q_file)
    assert torch.equal(s_ours[:rows], d_file)
    assert torch.equal(m_ours[:rows].float(), -8 * d_file.float())  # w = d * (q - 8)
    o_file, od_file = _q4_0_blocks(path, "blk.1.attn_output.weight")
    o_u, o_s, _ = unpack_int4(model.layers[1].self_attn.o_proj.int4.packed,
                              model.layers[1].self_attn.o_proj.int4.scales)
    assert torch.equal(o_u, o_file) and torch.equal(o_s, od_file)
    # Quantizing the bfloat16 copy instead would not give the file's weights back.
    w_file = dequantize_int4(q_file, d_file, (-8 * d_file.float()).half())
    u_re, s_re, _ = quantize_int4(w_file.bfloat16(), symmetric=True)
    assert not (torch.equal(u_re, q_file) and torch.equal(s_re, d_file))


# --- the model: float32 int4 equals transformers with the de-quantized weights --------------


def dequantized_hf(hf):
    """``hf`` with every projection replaced by its int4 de-quantized weight (groups along each
    row's input channels: the same groups as our fused rows), computed here from
    :func:`quantize_int4`'s levels, and the LM head by its int8 one (int4 keeps the head at 8
    bits); the embedding table stays (a tied head is untied)."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in names:
                module.weight.copy_(dequantize_int4(*quantize_int4(module.weight)))
        head = dequantize_int8_groups(*quantize_int8_groups(hf.lm_head.weight))
        hf.lm_head.weight = torch.nn.Parameter(head)
    return hf


@pytest.mark.parametrize("tie", [True, False])
def test_float32_int4_model_equals_transformers_on_dequantized_weights(tmp_path, tie) -> None:
    import transformers

    from splitserve.engine.model.loader import load_model
    from tests.engine.test_model_vs_hf import COMMON, Runner, hf_logits, tokens

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": tie,
                                      "attention_bias": True})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    model, our_cfg = load_model(tmp_path, torch.float32,
                                engine=EngineConfig(quantization="int4"))
    ref_hf = dequantized_hf(hf)
    ids = tokens(14, 5)
    ref = hf_logits(ref_hf, ids)
    run = Runner(model, our_cfg)
    pages = run.pages(14)
    first = run.step([ids[:9]], [0], [pages], all_logits=True)
    torch.testing.assert_close(first, ref[:9], atol=1e-4, rtol=0)
    for pos in range(9, 14):
        torch.testing.assert_close(run.step([[ids[pos]]], [pos], [pages])[0], ref[pos],
                                   atol=1e-4, rtol=0)
    # Quantization changed the model: the unquantized reference differs by far more.
    assert float((hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), ids)
                  - ref).abs().max()) > 1e-2
