"""Decode attention read straight from an 8-bit KV pool (``decode_attention_q8.c``) against
float64 attention over the values the pool stores (``float(code) * scale``), for int8 and
fp8_e4m3 pages: GQA group sizes 1-8, head sizes 16-128, pages in random order, rows of many
lengths (inside one page, across pages, over a page boundary), sliding windows, strided query
rows and page-table rows. And the worker's view of it: an 8-bit pool keeps no decode cache
(the bfloat16 copy the 8 bits would pay for) and the fused decode layers read it in place."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for
from tests.cpu_kernels import load_or_fail

kernels = load_or_fail()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler")
PAGE = 16
LENS = [1, 5, 16, 17, 40, 100, 0]  # the last row is empty: its output stays untouched


def _filled(kind: str, hkv: int, d: int, layers: int = 2) -> tuple[KVPool, torch.Tensor]:
    """A pool with every row of LENS written at every layer, pages in random order; the
    page table ``[R, 10]`` (wider than any row needs: the padding points at page 0)."""
    pool = KVPool(KVLayout(layers, hkv, d, PAGE, "bfloat16", kind), 64)
    g = torch.Generator().manual_seed(hkv * 1000 + d)
    order = (torch.randperm(63, generator=g) + 1).tolist()
    table = torch.zeros(len(LENS), 10, dtype=torch.long)
    for r, n in enumerate(LENS):
        ids = [order.pop() for _ in range(pages_for(n, PAGE))]
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        pos = torch.arange(n)
        for layer in range(layers):
            k = (3 * torch.randn(n, hkv, d, generator=g)).bfloat16()
            v = torch.randn(n, hkv, d, generator=g).bfloat16()
            pool.write(layer, table[r][pos // PAGE], pos % PAGE, k, v)
    return pool, table


def _stored(pool: KVPool, layer: int, kv: int, pages: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, Hkv, D]`` float64: the values the pool holds, code times scale, unrounded."""
    hkv, d = pool.layout.num_kv_heads, pool.layout.head_dim
    assert pool.scales is not None
    codes = pool.kv[pages, layer, kv].reshape(-1, hkv, d)[:n].float().double()
    scales = pool.scales[pages, layer, kv].reshape(-1, hkv)[:n].double()
    return codes * scales[..., None]


def _reference(q: torch.Tensor, pool: KVPool, layer: int, pages: torch.Tensor, n: int,
               window: int | None, scale: float) -> torch.Tensor:
    """``[Hq, D]`` float64 attention of one row's ``q [Hq, D]`` over its first ``n`` keys."""
    hkv, d = pool.layout.num_kv_heads, pool.layout.head_dim
    k, v = _stored(pool, layer, 0, pages, n), _stored(pool, layer, 1, pages, n)
    lo = max(0, n - window) if window else 0
    qg = (q.double() * scale).view(hkv, -1, d)
    probs = torch.einsum("hgd,nhd->hgn", qg, k[lo:]).softmax(-1)
    return torch.einsum("hgn,nhd->hgd", probs, v[lo:]).reshape(-1, d)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (14, 2, 64), (8, 8, 128), (8, 1, 16),
                                              (6, 2, 48)])
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_equals_float64_attention_over_the_stored_values(kind, hq, hkv, d, window):
    """Every row within the bfloat16 rounding of its output (half an ulp of values up to ~4:
    the sums are float32, and with AVX512-VNNI or AVX2 the int8 keys' scores integer sums
    against the query rounded to 16 bits per head) of float64 attention; the empty row's output
    untouched; and, so that the check can fail, the same kernel over a pool whose scales are
    all 1 is far off."""
    pool, table = _filled(kind, hkv, d)
    g = torch.Generator().manual_seed(7)
    # Strided rows, as slices of a fused q/k/v projection are; the table's rows are strided too.
    q = torch.randn(len(LENS), hq + 2 * hkv, d, generator=g).bfloat16()[:, :hq]
    lens = torch.tensor(LENS, dtype=torch.long)
    scale = d**-0.5
    for layer in (0, 1):
        out = torch.full((len(LENS), hq, d), 5.0, dtype=torch.bfloat16)
        kernels.decode_attention_q8(q, pool, layer, table[:, :8], lens, window, scale, out)
        for r, n in enumerate(LENS):
            if n == 0:
                assert torch.all(out[r] == 5.0)
                continue
            ref = _reference(q[r], pool, layer, table[r], n, window, scale)
            err = (out[r].double() - ref).abs().max().item()
            assert err <= 2.0**-8 * max(1.0, ref.abs().max().item()) + 1e-6, (layer, r, err)
    assert pool.scales is not None
    pool.scales.fill_(1.0)
    broken = torch.empty(len(LENS), hq, d, dtype=torch.bfloat16)
    kernels.decode_attention_q8(q, pool, 0, table[:, :8], lens, window, scale, broken)
    pool2, _ = _filled(kind, hkv, d)
    ref = _reference(q[5], pool2, 0, table[5], LENS[5], window, scale)
    assert (broken[5].double() - ref).abs().max().item() > 0.1


def test_kernel_refuses_what_it_cannot_read():
    pool, table = _filled("int8", 2, 64)
    q = torch.randn(len(LENS), 18, 64).bfloat16()  # G = 9 > 8
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="unsupported shape"):
        kernels.decode_attention_q8(q, pool, 0, table, torch.tensor(LENS), None, 0.1, out)
    q5 = torch.randn(len(LENS), 5, 64).bfloat16()  # 5 query heads over 2 KV heads
    with pytest.raises(ValueError, match="unsupported shape"):
        kernels.decode_attention_q8(q5, pool, 0, table, torch.tensor(LENS), None, 0.1,
                                    torch.empty_like(q5))
    with pytest.raises(ValueError, match="unsupported shape"):  # int32 page ids
        kernels.decode_attention_q8(q[:, :4], pool, 0, table.int(), torch.tensor(LENS), None,
                                    0.1, out[:, :4])
    bf16 = KVPool(KVLayout(1, 2, 64, PAGE, "bfloat16"), 4)
    with pytest.raises(ValueError, match="8-bit"):
        kernels.decode_attention_q8(q[:, :4], bf16, 0, table, torch.tensor(LENS), None, 0.1,
                                    out[:, :4])


@pytest.fixture(scope="module")
def bf16_fused_model(model_path):
    """The default model in bfloat16 with the C products at every step size (``--kernels c``:
    the fused decode layers need them)."""
    from splitserve.config import EngineConfig
    from splitserve.engine.model.loader import load_model

    return load_model(model_path, dtype=torch.bfloat16, engine=EngineConfig(kernels="c"))


def test_an_8bit_pool_keeps_no_decode_cache_and_the_fused_layers_read_it(bf16_fused_model,
                                                                         monkeypatch):
    """Through the model as a worker runs it (sequence ids, so a decode cache could be keyed):
    over a bfloat16 pool the decode steps fill the decode cache; over an int8 pool they take
    the fused layers with no cache at all, and the greedy tokens agree with the bfloat16
    pool's over these few steps (8-bit KV is within a percent of perplexity, docs/models.md)."""
    from splitserve.engine.attention.torch_backend import TorchAttentionBackend
    from splitserve.engine.forward_batch import build_forward_batch
    from splitserve.engine.model.fused_decode import FusedDecodeLayers

    model, cfg = bf16_fused_model
    runs: list[bool] = []
    real = FusedDecodeLayers.run

    def spy(self, *args, **kwargs):
        ran = real(self, *args, **kwargs)
        runs.append(ran)
        return ran

    prompt = list(range(400, 437))
    tokens = {}
    for kind in ("auto", "int8"):
        backend = model.attn_backend = TorchAttentionBackend()
        pool = KVPool(cfg.kv_layout(PAGE, "bfloat16", kind), 16)
        pages = [pool.allocator.alloc(pages_for(len(prompt) + 6, PAGE))]
        fb = build_forward_batch([prompt], [0], pages, PAGE, [0], seq_ids=[3])
        out = [int(model.forward(fb, pool).argmax(-1))]
        runs.clear()
        monkeypatch.setattr(FusedDecodeLayers, "run", spy)
        for step in range(5):
            fb = build_forward_batch([[out[-1]]], [len(prompt) + step], pages, PAGE, [0],
                                     seq_ids=[3])
            out.append(int(model.forward(fb, pool).argmax(-1)))
        monkeypatch.setattr(FusedDecodeLayers, "run", real)
        assert runs == [True] * 5, kind
        assert (backend.cache_bytes() > 0) == (kind == "auto"), kind
        assert backend.reads_pool_in_place(pool) == (kind == "int8")
        tokens[kind] = out
    assert tokens["auto"] == tokens["int8"]


@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3", "skylake-avx512"])
def test_the_paths_other_cpus_take(tmp_path, march):
    """The kernel as a CPU without AVX2 (plain C loops), one with AVX2 + FMA + F16C but no
    AVX-512 (int16 x int8 integer scores for int8 pages, vpmaddwd) and one with AVX-512 but no
    VNNI (float scores for int8 pages) builds it: the same float64 check, both kinds. Compiled
    here with that ``-march`` (the build uses ``-march=native``, so this machine's own path is
    the one above); skipped off x86-64, without gcc, or where this CPU cannot run the code."""
    import ctypes
    import platform
    import shutil
    import subprocess
    from pathlib import Path

    from splitserve.engine.kernels.cpu import pool_bindings
    from tests.cpu_kernels import cpu_flags

    gcc = shutil.which("gcc")
    if platform.machine() != "x86_64" or gcc is None:
        pytest.skip("needs gcc on x86-64")
    if march == "skylake-avx512" and not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    if march == "x86-64-v3" and not {"avx2", "fma", "f16c", "bmi2", "movbe"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    src = Path(pool_bindings.__file__).parent / "csrc"
    lib = tmp_path / "q8.so"
    subprocess.run([gcc, "-O2", f"-march={march}", "-fopenmp", "-fPIC", "-std=c11", "-shared",
                    "-o", str(lib), str(src / "decode_attention_q8.c")], check=True)
    fn = ctypes.CDLL(str(lib)).decode_attention_q8
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr] + [i64] * 6 + [ptr, i64, ptr] + [i64] * 5 + [ctypes.c_float,
                                                                              ptr]

    class Other:
        _decode_q8 = fn

    for kind in ("int8", "fp8_e4m3"):
        pool, table = _filled(kind, 3, 64)
        q = torch.randn(len(LENS), 9, 64).bfloat16()
        out = torch.zeros(len(LENS), 9, 64, dtype=torch.bfloat16)
        pool_bindings.PoolKernels.decode_attention_q8(
            Other(), q, pool, 1, table, torch.tensor(LENS), 7, 0.125, out)  # type: ignore[arg-type]
        for r, n in enumerate(LENS[:-1]):
            ref = _reference(q[r], pool, 1, table[r], n, 7, 0.125)
            err = (out[r].double() - ref).abs().max().item()
            assert err <= 2.0**-8 * max(1.0, ref.abs().max().item()) + 1e-6, (kind, r, err)


def test_heads_the_kernel_does_not_take_gather_from_the_8bit_pool():
    """16 query heads per KV head (over the C kernel's 8): decode rows over an int8 pool fall
    back to the gather path with its masks, built for the step when first needed, and agree
    with float64 attention over the stored values (bfloat16 scores there: 3e-2)."""
    from splitserve.engine.attention.torch_backend import TorchAttentionBackend
    from splitserve.engine.forward_batch import build_forward_batch

    hkv, hq, d = 2, 32, 16
    pool, table = _filled("int8", hkv, d, layers=1)
    rows = [1, 4]  # lengths 5 and 40: each row's new token is its last stored one
    backend = TorchAttentionBackend()
    lens = [LENS[r] - 1 for r in rows]
    pages = [table[r, : pages_for(LENS[r], PAGE)].tolist() for r in rows]
    batch = build_forward_batch([[1]] * len(rows), lens, pages, PAGE, [], "cpu", seq_ids=rows)
    meta = backend.prepare(batch, pool, None)
    assert meta.decode_in_pool and meta.decode_biases is None
    q = torch.randn(len(rows), hq, d).bfloat16()
    # the new tokens' K/V: what the pool holds at their position (the step writes them again)
    k = torch.stack([_stored(pool, 0, 0, table[r], LENS[r])[-1] for r in rows]).bfloat16()
    v = torch.stack([_stored(pool, 0, 1, table[r], LENS[r])[-1] for r in rows]).bfloat16()
    out = backend.forward(q, k, v, 0, meta, pool, d**-0.5)
    for i, r in enumerate(rows):
        ref = _reference(q[i], pool, 0, table[r], LENS[r], None, d**-0.5)
        assert torch.allclose(out[i].double(), ref, atol=3e-2, rtol=3e-2), r
