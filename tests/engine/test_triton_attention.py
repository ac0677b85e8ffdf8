"""Triton paged attention (decode and extend kernels) against the torch backend.

On a machine without CUDA the kernels run under Triton's CPU interpreter: ``TRITON_INTERPRET=1``
is set (by ``triton_device``, imported first) before anything imports Triton's JIT for our
kernels (Triton chooses interpreter or compiler when a kernel is decorated). On CUDA the same
tests run the compiled kernels. Shapes are tiny because the interpreter executes each program in
Python.
"""

from __future__ import annotations

import random

import pytest
import torch

# isort: off
from triton_device import DEVICE  # first: it sets TRITON_INTERPRET before Triton loads
import triton
import triton.language as tl
# isort: on

from splitserve.config import EngineConfig
from splitserve.engine.attention.base import create_attention_backend, default_attention_backend
from splitserve.engine.attention.torch_backend import TorchAttentionBackend
from splitserve.engine.attention.triton.backend import TritonAttentionBackend
from splitserve.engine.attention.triton.paged_tile import _fp8_e4m3_to_f32
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def run_both(
    plan: list[tuple[int, int]],
    hq: int,
    hkv: int,
    head_dim: int,
    dtype: torch.dtype,
    page_size: int = 4,
    window: int | None = None,
    num_splits: int | None = None,
    seed: int = 0,
    kv_cache_dtype: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention layer over a random pool, torch and Triton backends.

    Args:
        plan: per sequence ``(cached_len, new_len)``; the cached K/V is random pool content.
        num_splits: force the decode kernel's split count (default: its own choice).
        kv_cache_dtype: an 8-bit pool (``int8``, ``fp8_e4m3``) is filled through
            ``KVPool.write``, so every slot holds quantized values and their scales.

    Returns:
        ``(torch output, triton output)``, each ``[T, hq, head_dim]``.
    """
    gen = torch.Generator().manual_seed(seed)
    total_pages = sum(pages_for(c + n, page_size) for c, n in plan) + 3
    dtype_str = str(dtype).removeprefix("torch.")
    layout = KVLayout(2, hkv, head_dim, page_size, dtype_str, kv_cache_dtype)
    pool = KVPool(layout, total_pages, device=DEVICE)
    if layout.is_quantized:
        pages = torch.arange(total_pages).repeat_interleave(page_size).to(DEVICE)
        slots = torch.arange(page_size).repeat(total_pages).to(DEVICE)
        for layer in range(layout.num_layers):
            # Per-token magnitudes that differ, so a scale read for the wrong token shows.
            mag = torch.rand(2, pages.numel(), hkv, 1, generator=gen) + 0.1
            k, v = torch.randn(2, pages.numel(), hkv, head_dim, generator=gen) * mag
            pool.write(layer, pages, slots, k.to(DEVICE, dtype), v.to(DEVICE, dtype))
    else:
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    free = list(range(1, total_pages))
    random.Random(seed).shuffle(free)  # non-contiguous, out-of-order pages
    page_lists = []
    for c, n in plan:
        k = pages_for(c + n, page_size)
        page_lists.append(free[:k])
        free = free[k:]
    chunks = [[0] * n for _, n in plan]
    batch = build_forward_batch(
        chunks, [c for c, _ in plan], page_lists, page_size, [], device=DEVICE
    )
    t = sum(n for _, n in plan)
    # q as a slice of a wider tensor, like the model's fused q|k projection (non-contiguous).
    qk = torch.randn(t, hq + hkv, head_dim, generator=gen).to(DEVICE, dtype)
    q = qk[:, :hq]
    k = torch.randn(t, hkv, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(t, hkv, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim**-0.5
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        meta = backend.prepare(batch, pool, window)
        if num_splits is not None and isinstance(backend, TritonAttentionBackend):
            meta.decode.num_splits = num_splits
        outs.append(backend.forward(q, k, v, 1, meta, pool, scale).float().cpu())
    return outs[0], outs[1]


DECODE = [(0, 1), (4, 1), (16, 1), (69, 1)]  # seq lens 1, 5, 17, 70 (two K/V blocks)


@pytest.mark.parametrize(
    ("hq", "hkv", "dtype"),
    [(2, 2, torch.float32), (6, 2, torch.float32), (6, 2, torch.bfloat16)],
)
def test_decode(hq: int, hkv: int, dtype: torch.dtype) -> None:
    ref, out = run_both(DECODE, hq, hkv, 64, dtype)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=0)


@triton.jit
def _decode_fp8_bytes(X, Y):
    offs = tl.arange(0, 256)
    tl.store(Y + offs, _fp8_e4m3_to_f32(tl.load(X + offs)))


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype"),
    # fp8 differs from int8 only in the byte decoder, which the next test checks on every byte.
    [("int8", torch.float32), ("int8", torch.bfloat16), ("fp8_e4m3", torch.float32)],
)
def test_8bit_pool_decode_and_extend(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """An 8-bit pool read by the Triton kernels equals the torch backend, which de-quantizes
    through ``KVPool.gather``: decode with split-K and a window, extend over a cached prefix."""
    for plan, kw in (
        (DECODE, {"num_splits": 3}),
        (DECODE, {"window": 7}),
        ([(0, 13), (9, 7), (37, 3), (20, 1)], {"seed": 1}),
    ):
        ref, out = run_both(plan, 6, 2, 64, dtype, kv_cache_dtype=kv_cache_dtype, **kw)
        # bfloat16: outputs up to ~3 here, where 2 ulps (the two paths round p and the sums
        # differently) exceed the absolute bound; float32 stays exact to 2e-5.
        rtol = 2**-6 if dtype == torch.bfloat16 else 0
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=rtol)


def test_8bit_pool_fp8_decoder_is_exact() -> None:
    """The kernels' integer e4m3fn decoder equals torch's float8 conversion on all 256 bytes
    (NaN, 0x7f/0xff, excepted: quantize_kv never writes it)."""
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _decode_fp8_bytes[(1,)](raw, out)
    ref = raw.view(torch.float8_e4m3fn).float()
    finite = ~ref.isnan()
    assert finite.sum() == 254
    assert torch.equal(out[finite], ref[finite])


def test_decode_split_k_window_and_padded_head_dim() -> None:
    """Three splits (one of them empty for the shortest row), a sliding window, D=48 (padded)."""
    for window, splits in ((None, 3), (7, 3), (None, 1)):
        ref, out = run_both(DECODE, 3, 1, 48, torch.float32, window=window, num_splits=splits)
        torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize(
    ("hq", "hkv", "dtype"),
    [(2, 2, torch.float32), (6, 2, torch.float32), (6, 2, torch.bfloat16)],
)
def test_extend_with_and_without_prefix(hq: int, hkv: int, dtype: torch.dtype) -> None:
    plan = [(0, 13), (9, 7), (37, 3)]  # fresh prompt; cached prefix; prefix crossing a block
    ref, out = run_both(plan, hq, hkv, 64, dtype, seed=1)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=0)


def test_mixed_batch_window_page_size_16_float16() -> None:
    """Decode and extend rows in one step, a sliding window, bigger pages, float16."""
    plan = [(0, 11), (20, 1), (5, 6), (3, 1)]
    for dtype, window in ((torch.float32, 5), (torch.float16, None)):
        ref, out = run_both(plan, 4, 2, 64, dtype, page_size=16, window=window, seed=2)
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=0)


def test_backend_choice(monkeypatch) -> None:
    monkeypatch.delenv("SPLITSERVE_ATTENTION", raising=False)
    assert default_attention_backend("cpu") == "torch"
    assert default_attention_backend(torch.device("cuda", 0)) == "triton"
    monkeypatch.setenv("SPLITSERVE_ATTENTION", "torch")
    assert default_attention_backend("cuda", EngineConfig().attention) == "torch"
    assert isinstance(create_attention_backend("triton"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="triton"):
        create_attention_backend("nope")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tiny_model_logits_match_torch_backend(tmp_path, kv_cache_dtype: str) -> None:
    """A tiny random Mistral (GQA 3, sliding window 6) through prefill, prefill over a cached
    prefix mixed with decode, and decode: the same logits through both backends (an 8-bit
    pool too)."""
    import transformers

    from splitserve.engine.model.loader import load_model

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=64, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=6, initializer_range=0.2,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    logits = []
    for name in ("torch", "triton"):
        model, mcfg = load_model(tmp_path, attn_backend=create_attention_backend(name))
        model.to(DEVICE)
        pool = KVPool(mcfg.kv_layout(4, "float32", kv_cache_dtype), 16, device=DEVICE)
        pages = [[5, 2, 9, 7, 1], [3, 8, 6]]
        steps = [
            ([list(range(3, 12)), list(range(20, 26))], [0, 0]),  # two fresh prompts
            ([list(range(30, 36)), [40]], [9, 6]),  # extend over a prefix; a decode row
            ([[41], [42]], [15, 7]),  # decode only
        ]
        for chunks, prefix in steps:
            batch = build_forward_batch(chunks, prefix, pages, 4, [0, 1], device=DEVICE)
            logits.append(model(batch, pool).cpu())
    n = len(logits) // 2
    for ref, out in zip(logits[:n], logits[n:], strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
