"""Triton weight-only int8/int4 products (``engine.kernels.triton.quant_matmul``) against
``F.linear`` on the de-quantized weight ``W'``, and a quantized model on the Triton path against
the CPU float32 path on the same ``W'``.

Without CUDA the kernels run under Triton's CPU interpreter (``triton_device``, imported first,
sets ``TRITON_INTERPRET=1``), and the model test routes the CPU model through the CUDA wiring
(``layers.on_cuda`` patched to say yes): the same code, interpreted. Shapes are tiny because the
interpreter runs each program in Python.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

# isort: off
from triton_device import DEVICE  # first: it sets TRITON_INTERPRET before Triton loads
# isort: on

from splitserve.config import EngineConfig
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kernels.triton import quant_matmul
from splitserve.engine.kernels.triton.quant_matmul import (
    TritonInt4Weight,
    TritonInt8Weight,
    pack_int4_gpu,
    unpack_int4_gpu,
)
from splitserve.engine.kv_pool import KVPool, pages_for
from splitserve.engine.model import layers, quant, quant_int4
from splitserve.engine.model.loader import load_model
from splitserve.engine.model.quant import dequantize_int8, quantize_int8
from splitserve.engine.model.quant_int4 import dequantize_int4, quantize_int4

pytestmark = pytest.mark.usefixtures("one_thread")

# |y - ref| <= EPS * (|x| @ |W'|.T + |b|), S for short. Rounding to the serving dtype costs at
# most u = 2^-8 (bfloat16) or 2^-11 (float16) relative: the reference rounds W' (int8 only: the
# kernel's levels are exact and its scale is applied in float32; under int4 both round the same
# float32 W', the value the model's parameter holds), its matmul output and its bias sum, and
# the kernel its output once: at most 4 u S apart. Float32 differs by the order of its sums
# only (K <= 160 terms, 2^-24 each).
EPS = {torch.float32: 1e-5, torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}
SHAPES = [(72, 96), (40, 160)]  # N past one 64-column block / under one; K % 64 != 0


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """``y`` against ``F.linear(x, w.to(x.dtype), b)`` within :data:`EPS` (``w`` float32)."""
    ref = F.linear(x, w.to(x.dtype), b).float()
    mags = x.float().abs() @ w.abs().T + (0 if b is None else b.float().abs())
    err = (y.float() - ref).abs()
    bound = EPS[x.dtype] * mags + 1e-6
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert bool((err <= bound).all()), (
        f"max err {err.max():.3g}, worst excess {(err - bound).max():.3g}"
    )


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05 + 0.02  # off-centre groups: int4 offsets matter
    x = (torch.randn(m, k, generator=gen) * 2).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return w, x, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int8_product_equals_linear_on_dequantized_weight(m, n, k, bias, dtype) -> None:
    w, x, b = _inputs(m, n, k, dtype, bias, m * n + k)
    q, s = quantize_int8(w)
    y = TritonInt8Weight(q.to(DEVICE), s.to(DEVICE))(x, b)
    _check(y.cpu(), x.cpu(), dequantize_int8(q, s), None if b is None else b.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int4_product_equals_linear_on_dequantized_weight(m, n, k, bias, dtype) -> None:
    w, x, b = _inputs(m, n, k, dtype, bias, m * n + k + 1)
    u, s, o = quantize_int4(w)
    y = TritonInt4Weight(u.to(DEVICE), s.to(DEVICE), o.to(DEVICE))(x, b)
    _check(y.cpu(), x.cpu(), dequantize_int4(u, s, o), None if b is None else b.cpu())


def test_products_keep_leading_dims_and_take_empty_steps() -> None:
    w, x, _ = _inputs(6, 40, 64, torch.float32, False, 7)
    q, s = quantize_int8(w)
    w8 = TritonInt8Weight(q.to(DEVICE), s.to(DEVICE))
    u, s4, o4 = quantize_int4(w)
    w4 = TritonInt4Weight(u.to(DEVICE), s4.to(DEVICE), o4.to(DEVICE))
    for weight in (w8, w4):
        assert weight(x.reshape(2, 3, 64)).shape == (2, 3, 40)
        assert weight(x[:0]).shape == (0, 40)
        with pytest.raises(ValueError, match="features"):
            weight(x[:, :32])


def test_int4_gpu_layout_round_trips_and_is_n_contiguous() -> None:
    assert quant_matmul.GROUP == quant_int4.GROUP
    gen = torch.Generator().manual_seed(3)
    u = torch.randint(0, 16, (24, 96), generator=gen, dtype=torch.uint8)
    s, o = torch.rand(2, 24, 3, generator=gen).half()
    packed, ps, po = pack_int4_gpu(u, s, o)
    assert packed.shape == (48, 24) and ps.shape == po.shape == (3, 24)
    # Byte [16 g + j, n]: U[n, 32 g + j] low, U[n, 32 g + 16 + j] high.
    assert int(packed[16 + 5, 7]) == int(u[7, 32 + 5]) | (int(u[7, 48 + 5]) << 4)
    back = unpack_int4_gpu(packed, ps, po)
    assert torch.equal(back[0], u) and torch.equal(back[1], s) and torch.equal(back[2], o)
    with pytest.raises(ValueError, match="K % 32"):
        pack_int4_gpu(u[:, :40], s, o)


def test_gguf_q4_0_weight_keeps_its_grid_on_the_gpu_path() -> None:
    """``exact`` (a Q4_0 tensor's float32 values) is quantized on Q4_0's symmetric grid, as on
    CPU: the packed levels and scales are the file's (here: built from chosen levels)."""
    from splitserve.engine.model.quant_gpu import gpu_int4

    gen = torch.Generator().manual_seed(11)
    d = (torch.rand(8, 2, generator=gen) + 0.5).half()
    levels = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    levels[:, 0] = 0  # -8 d in every group: the largest magnitude, so d is recovered exactly
    levels[:, 32] = 0
    exact = dequantize_int4(levels, d, (-8 * d.float()).half())
    weight = exact.bfloat16().to(DEVICE)  # the rounded serving copy, not what is quantized
    packed = gpu_int4(weight, exact)
    u, s, m = unpack_int4_gpu(packed.packed, packed.scales, packed.offsets)
    assert torch.equal(u.cpu(), levels) and torch.equal(s.cpu(), d)
    assert torch.equal(m.cpu(), (-8 * d.float()).half())


# --- the model: the Triton path equals the CPU float32 path on the de-quantized weights --------


def _logits(model, cfg, device: str, ids: list[int], prompt: int) -> torch.Tensor:
    """Logits of every position ``[len(ids), vocab]``: one prefill of ``prompt`` tokens (all
    scored), then one decode step per remaining token, on shuffled pages."""
    page_size = 4
    pool = KVPool(cfg.kv_layout(page_size, "float32"), 16, device)
    pages = pool.allocator.alloc(pages_for(len(ids), page_size))
    random.Random(0).shuffle(pages)
    out = []
    for start, chunk in [(0, ids[:prompt])] + [(p, [ids[p]]) for p in range(prompt, len(ids))]:
        batch = build_forward_batch([chunk], [start], [pages], page_size, [0], device)
        batch.logit_indices = torch.arange(len(chunk), device=device)
        out.append(model(batch, pool).cpu())
    return torch.cat(out)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_model_on_triton_path_equals_cpu_float32(
    tmp_path, monkeypatch, scheme, tie
) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, tie_word_embeddings=tie, attention_bias=True,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    engine = EngineConfig(quantization=scheme)
    # The CPU reference with CUDA's int8 scheme (one scale per row, where the CPU's int8 has one
    # per block of 32): the row's scale repeated for each of its blocks is that scheme exactly.
    with monkeypatch.context() as m:
        def per_row_as_blocks(w):
            q, s = quantize_int8(w)
            return q, s[:, None].expand(-1, -(-w.shape[1] // quant.GROUP)).contiguous()
        m.setattr(quant, "quantize_int8_groups", per_row_as_blocks)
        ref_model, ref_cfg = load_model(tmp_path, torch.float32, engine=engine)  # F.linear on W'
    plain, _ = load_model(tmp_path, torch.float32)
    if DEVICE == "cpu":  # no CUDA: the CUDA wiring, on CPU tensors, with interpreted kernels
        monkeypatch.setattr(layers, "on_cuda", lambda weight: True)
    model, our_cfg = load_model(tmp_path, torch.float32, device=DEVICE, engine=engine)

    projections = [m for m in model.layers.modules() if isinstance(m, layers.Linear)]
    assert all(m.gpu_weight is not None and m.weight.numel() == 0 for m in projections)
    if not tie:  # the untied head's float parameter is released too (its int8 copy serves)
        assert model.lm_head.weight.numel() == 0
    assert isinstance(model.head.gpu_weight, TritonInt8Weight)  # the head is int8 under both
    assert model.weight_bytes() < ref_model.weight_bytes() / 2

    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = _logits(ref_model, ref_cfg, "cpu", ids, 8)
    ours = _logits(model, our_cfg, DEVICE, ids, 8)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # Quantization changed the model, so the check above compares quantized with quantized.
    assert float((_logits(plain, ref_cfg, "cpu", ids, 8) - ref).abs().max()) > 1e-3
