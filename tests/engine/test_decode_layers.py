"""The fused decode layers (one C call for every layer of a decode step) against the per-op path
they replace: the default model in bfloat16 through the scheduler gives the same tokens and
bit-identical logprobs with and without them, and they run when they should; 3 rows (the skinny
kernel at 1-2 rows, the AVX512_BF16 tiles at 3) and 9 rows (the tiles down to 3); the same with
int8 and int4 weights (``--quantization int8|int4``: the VNNI products in both paths; int8 also
on AVX2, ``gemm_w8.c``'s AVX2 path)."""

from __future__ import annotations

import pytest
import torch

from splitserve.config import EngineConfig
from splitserve.engine.kv_pool import KVPool
from tests.cpu_kernels import (
    VNNI_KERNEL_FLAGS,
    check_kernel,
    load_or_fail,
    require_onednn_pack,
    w8_kernel_flags,
)

pytestmark = pytest.mark.skipif(load_or_fail() is None, reason="no C compiler")


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("num_reqs", [3, 9])
def test_fused_decode_layers_equal_the_per_op_path(
    model_path, monkeypatch, num_reqs, quantization
) -> None:
    from splitserve.engine.model.fused_decode import FusedDecodeLayers
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.sched.request import Req
    from splitserve.ipc.messages import SamplingParams
    from tests.engine_core import make_core

    kernels = load_or_fail()  # without their kernel the int8/int4 weights serve de-quantized
    if quantization == "int8":  # AVX512-VNNI, or the AVX2 path where there is no AVX-512
        check_kernel(kernels, kernels is not None and kernels.has_w8, w8_kernel_flags(),
                     "int8 products")
    if quantization == "int4":
        check_kernel(kernels, kernels is not None and kernels.has_w4, VNNI_KERNEL_FLAGS,
                     "int4 products")
    # C products at every step size this test runs (the fused path needs them).
    # int8: the fused path calls gemm_w8.c as the per-op path does (--quantization int8).
    engine = EngineConfig(kernels="c", quantization=quantization)
    model, cfg = load_model(model_path, dtype=torch.bfloat16, engine=engine)
    calls = {"ran": 0}
    real = FusedDecodeLayers.run

    def counting(self, *args, **kwargs):
        ran = real(self, *args, **kwargs)
        calls["ran"] += ran
        return ran

    monkeypatch.setattr(FusedDecodeLayers, "run", counting)

    def run(fused: bool) -> list[tuple[list[int], list[float]]]:
        model.fused_decode = fused
        model.attn_backend.decode_cache = None
        pool = KVPool(cfg.kv_layout(16, "bfloat16"), 128)
        core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=64,
                         max_running=num_reqs)
        sched = core.scheduler
        g = torch.Generator().manual_seed(0)
        reqs = []
        for i in range(num_reqs):  # all rows, then one fewer each time one finishes
            ids = torch.randint(100, 40000, (5 + 23 * i,), generator=g).tolist()
            params = SamplingParams(temperature=0.0, max_new_tokens=6 + 5 * i, ignore_eos=True)
            reqs.append(Req(rid=str(i), input_ids=ids, sampling=params))
            sched.add(reqs[-1])
        while sched.has_work:
            core.step()
        return [(r.output_ids, r.output_logprobs) for r in reqs]

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_op = run(False)
        assert calls["ran"] == 0
        fused = run(True)
    finally:
        torch.set_num_threads(before)
        model.fused_decode = True
    assert calls["ran"] >= 15  # every decode-only step of the second run
    assert fused == per_op  # same tokens, bit-identical logprobs


@require_onednn_pack()
def test_weight_bytes_count_the_packed_copies(model_path, monkeypatch) -> None:
    """``/workers``' weight_bytes: the parameters, plus oneDNN's and the C kernels' copies of
    every projection and the LM head once packed (CPU bfloat16), which stand in for the
    projections' plain weights: those are released (two copies of each, not three)."""
    from splitserve.engine.model.layers import Linear
    from splitserve.engine.model.loader import load_model

    model, _ = load_model(model_path, dtype=torch.bfloat16)
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert projections and all(m.packed is not None and m.weight.numel() == 0
                               for m in projections)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    linear = sum(m.out_features * m.in_features * 2 for m in projections)
    head = model.embed_tokens.weight.numel() * 2  # tied: the table stays (lookups read it)
    assert model.head.packed is not None and model.head.decode_packed is not None
    assert model.weight_bytes() == params + 2 * (linear + head)
    monkeypatch.setenv("SPLITSERVE_PACK_WEIGHTS", "0")
    plain, _ = load_model(model_path, dtype=torch.bfloat16)
    assert plain.weight_bytes() == params + linear  # the plain weights stay unpacked
    assert model.weight_bytes() == plain.weight_bytes() + linear + 2 * head


@require_onednn_pack()
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_packing_keeps_one_copy_per_path_and_an_untied_head_once(tmp_path, quantization) -> None:
    """After ``pack_weights`` no projection keeps its plain weight (the packed copies serve
    every product: oneDNN's gives ``F.linear``'s values bit for bit), and an untied LM head is
    packed once, by the head, its parameter released (it was packed a second time as a
    projection); under int8 the head's de-quantized copy is released too."""
    import torch.nn.functional as F
    import transformers

    from splitserve.engine.model.layers import Linear
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.step_plan import Product
    from tests.engine.test_model_vs_hf import COMMON

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": False})
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    engine = EngineConfig(pack_weights=False, quantization=quantization)
    model, _ = load_model(tmp_path, torch.bfloat16, engine=engine)
    assert model.lm_head is not None and model.head.weight is not model.embed_tokens.weight
    head_w = model.head.weight.detach().clone()
    projections = [m for m in model.layers.modules() if isinstance(m, Linear)]
    plain = [m.weight.detach().clone() for m in projections]
    assert model.pack_weights()
    assert model.lm_head.packed is None and model.lm_head.decode_packed is None
    assert model.lm_head.weight.numel() == 0 and model.head.weight.numel() == 0
    h = torch.randn(6, COMMON["hidden_size"]).bfloat16()
    assert torch.equal(model.head(h, Product.TORCH), F.linear(h, head_w).float())
    assert model.head(h[:0], Product.TORCH).shape == (0, COMMON["vocab_size"])
    for m, w in zip(projections, plain, strict=True):
        assert m.packed is not None and m.weight.numel() == 0
        x = torch.randn(6, m.in_features).bfloat16()
        assert torch.equal(m(x, Product.TORCH), F.linear(x, w, m.bias))
