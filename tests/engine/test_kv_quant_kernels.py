"""The C writers of 8-bit KV pages (``kv_quant.c``) against the torch code they replace: the
quantizer bit for bit against ``kv_quant.quantize_kv`` / ``round_trip_kv`` (every finite
bfloat16 value, ties, zeros, subnormals, the largest values), and the default model's decode
steps over an int8 / fp8_e4m3 pool through the fused C layers, the per-op path with the C KV
append, and the torch append the per-op path used before: the same logits, pool bytes and
greedy tokens."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_quant import quantize_kv, round_trip_kv
from tests.cpu_kernels import BF16_KERNEL_FLAGS, cpu_flags, load_or_fail

kernels = load_or_fail()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler")
KINDS = ["int8", "fp8_e4m3"]


def _finite_bf16() -> torch.Tensor:
    """Every finite bfloat16 value (both zeros, subnormals, the largest), as bfloat16."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    return x[torch.isfinite(x.float())]


def _vectors(kind: str) -> torch.Tensor:
    """``[N, 64]`` bfloat16 vectors: every finite value under a range of maxima (the first
    element sets the scale), ties of each format's rounding, zeros, random vectors."""
    values = _finite_bf16().float()
    rows = []
    for amax in (448.0, 127.0, 1.0, 3.3e38, 1e-3, 2.0**-120, 9.2e-41, 7.0):
        amax = torch.tensor(amax).bfloat16().float()
        small = values[values.abs() <= amax]
        pad = torch.arange((-small.numel()) % 63) % small.numel()
        small = torch.cat([small, small[pad]])  # whole rows of 63
        body = small.view(-1, 63)
        rows.append(torch.cat([amax.expand(body.shape[0], 1), body], 1))
    # Ties: with amax 127 (int8) or 448 (fp8) the scale is 1 and these sit halfway between
    # two codes (int8: k + 0.5; fp8: between grid points, normal and subnormal, up to 440).
    if kind == "int8":
        ties = torch.arange(-126.5, 127.0, 1.0)
        top = 127.0
    else:
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[torch.isfinite(grid)].unique()
        ties = (grid[1:] + grid[:-1]) / 2
        top = 448.0
    ties = torch.cat([ties, torch.full(((-ties.numel()) % 63,), 0.5)]).view(-1, 63)
    rows.append(torch.cat([torch.full((ties.shape[0], 1), top), ties], 1))
    rows.append(torch.zeros(2, 64))
    rows.append(-torch.zeros(1, 64))
    g = torch.Generator().manual_seed(0)
    rows.append(torch.randn(4000, 64, generator=g) * torch.logspace(-38, 38, 4000)[:, None])
    x = torch.cat(rows).bfloat16()
    assert torch.isfinite(x.float()).all()
    return x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [64, 8])
def test_c_quantizer_equals_torch_bit_for_bit(kind, d) -> None:
    """``D = 64``: the AVX-512 path (16 lanes); ``D = 8``: the scalar path, the same values."""
    assert kernels is not None
    x = _vectors(kind).view(-1, d)
    q, scales, rt = kernels.kv_quantize(x, kind)
    ref_q, ref_scales = quantize_kv(x, kind)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scales, ref_scales)
    ref_rt = round_trip_kv(x, kind)
    assert torch.equal(rt.view(torch.int16), ref_rt.view(torch.int16))  # -0.0 included


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_steps_over_8bit_pool_equal_across_paths(model_path, monkeypatch, kind, rows):
    """Prefill three prompts, then decode greedily: the fused C layers, the per-op path with
    the C KV append, and the per-op path with the torch append (``KVPool.write`` and the decode
    cache's append: the code before, prefill writes included) give equal logits and pool bytes
    at every step (so equal tokens), and each path ran as meant."""
    from splitserve.config import EngineConfig
    from splitserve.engine.attention.torch_backend import TorchAttentionBackend
    from splitserve.engine.forward_batch import build_forward_batch
    from splitserve.engine.kv_pool import KVPool, pages_for
    from splitserve.engine.model.fused_decode import FusedDecodeLayers
    from splitserve.engine.model.loader import load_model

    model, cfg = load_model(model_path, torch.bfloat16, engine=EngineConfig(kernels="c"))
    counts = {"fused": 0, "c_append": 0}
    real_fused, real_append = (
        FusedDecodeLayers.run,
        TorchAttentionBackend._append_with_kernel,
    )

    def fused(self, *args, **kwargs):
        ran = real_fused(self, *args, **kwargs)
        counts["fused"] += ran
        return ran

    def append(self, *args, **kwargs):
        if counts.get("torch_append"):
            return False  # the per-op path as it was: pool.write, then the cache's append
        ran = real_append(self, *args, **kwargs)
        counts["c_append"] += ran
        return ran

    monkeypatch.setattr(FusedDecodeLayers, "run", fused)
    monkeypatch.setattr(TorchAttentionBackend, "_append_with_kernel", append)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (9, 30, 17)]
    prompts = prompts[:rows]
    steps, page = 5, 16

    def run(path: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        model.fused_decode = path == "fused"
        counts["torch_append"] = path == "torch"
        model.attn_backend = TorchAttentionBackend()
        pool = KVPool(cfg.kv_layout(page, "bfloat16", kind), 32)
        pages = [pool.allocator.alloc(pages_for(len(p) + steps, page)) for p in prompts]
        fb = build_forward_batch(
            prompts, [0] * rows, pages, page, list(range(rows)), seq_ids=list(range(rows))
        )
        logits = [model.forward(fb, pool)]
        lens = [len(p) for p in prompts]
        for _ in range(steps):
            tokens = logits[-1].argmax(-1).tolist()
            fb = build_forward_batch(
                [[t] for t in tokens],
                lens,
                pages,
                page,
                list(range(rows)),
                seq_ids=list(range(rows)),
            )
            logits.append(model.forward(fb, pool))
            lens = [n + 1 for n in lens]
        return logits, pool.buffer.clone()

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch_logits, torch_pool = run("torch")
        assert counts == {"fused": 0, "c_append": 0, "torch_append": True}
        per_op_logits, per_op_pool = run("per_op")
        # The C append writes every layer's prefill K/V too, then each step's.
        assert counts["fused"] == 0 and counts["c_append"] == (1 + steps) * cfg.num_layers
        fused_logits, fused_pool = run("fused")
        assert counts["fused"] == steps and counts["c_append"] == (2 + steps) * cfg.num_layers
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(torch_logits, per_op_logits, fused_logits, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(torch_pool, per_op_pool) and torch.equal(torch_pool, fused_pool)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 20])
def test_extend_attention_over_8bit_pool_equals_bf16_kernel_on_dequantized(kind, window):
    """The C extend attention reading an 8-bit pool (de-quantizing rows as it packs them) gives
    the bfloat16 kernel's bits over a bfloat16 pool that holds the de-quantized values; the
    sequence's pages in shuffled order, a whole prompt and a chunk over a prefix."""
    from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for

    assert kernels is not None
    torch.manual_seed(4)
    ps, hkv, d, s = 16, 3, 64, 75
    q8 = KVPool(KVLayout(2, hkv, d, ps, "bfloat16", kind), 12)
    bf16 = KVPool(KVLayout(2, hkv, d, ps, "bfloat16"), 12)
    pages = (torch.randperm(11)[: pages_for(s, ps)] + 1).contiguous()
    pos = torch.arange(s)
    for layer in range(2):
        ks = torch.randn(s, hkv, d) * torch.logspace(-2, 1, s)[:, None, None]
        q8.write(layer, pages[pos // ps], pos % ps, ks.bfloat16(), torch.randn(s, hkv, d))
    everything = torch.arange(12)
    bf16.buffer.copy_(q8.gather_pages(everything, torch.bfloat16))
    q = torch.randn(s, 9, d).bfloat16()
    for n in (s, 29):
        want = kernels.extend_attention(q[-n:], bf16.buffer, 1, pages, s, window, d**-0.5)
        if want is None:  # a skip only where the CPU lacks the flags the kernel is built for
            assert not set(BF16_KERNEL_FLAGS) <= cpu_flags(), "this CPU has AVX512_BF16 but " \
                "the C build has no bfloat16 extend kernel"
            pytest.skip("this CPU lacks avx512_bf16 (/proc/cpuinfo): no bf16 extend kernel")
        got = kernels.extend_attention_q8(q[-n:], q8, 1, pages, s, window, d**-0.5)
        assert got is not None and torch.equal(got.view(torch.int16), want.view(torch.int16))
