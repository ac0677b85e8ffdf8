"""The decode products' kernel, chosen by measurement (``engine.model.kernel_plan``): the
crossover rule, forced and file plans, the per-machine cache, that the plan decides which
kernel each step size takes, and that a chosen path gives the same bits as forcing it."""

from __future__ import annotations

import pytest
import torch

from splitserve.config import EngineConfig
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model import kernel_plan
from splitserve.engine.model.kernel_plan import ProductPlan, choose_product_plan, crossover
from splitserve.engine.model.layers import Linear, can_pack, packed_linear
from splitserve.engine.sched.request import Req
from splitserve.engine.step_plan import StepShape, plan_step
from splitserve.ipc.messages import SamplingParams
from tests.cpu_kernels import VNNI_KERNEL_FLAGS, check_kernel, load_or_fail
from tests.engine_core import make_core

kernels = load_or_fail()
needs_both = pytest.mark.skipif(
    kernels is None or not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)),
    reason="needs the C kernels and oneDNN bf16 packing",
)


def test_crossover_is_the_last_bucket_of_the_first_run_of_wins() -> None:
    b = (1, 2, 4, 8)
    assert crossover([1, 1, 1, 1], [2, 2, 2, 2], b) == 8
    assert crossover([1, 1, 3, 1], [2, 2, 2, 2], b) == 2  # a win after a loss does not count
    assert crossover([3, 1, 1, 1], [2, 2, 2, 2], b) == 0
    assert crossover([1.04, 2], [1.0, 1.0], (1, 2)) == 1  # within the tie margin: C


def test_forced_and_file_plans(tmp_path) -> None:
    assert choose_product_plan(None, "c", 128) == ProductPlan(128, 128, "forced: --kernels c")
    assert choose_product_plan(None, "torch", 128).layer_rows == 0
    plan = ProductPlan(6, 2, "x", ((1, 1.0, 2.0, 3.0, 4.0),))
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    got = choose_product_plan(None, str(path), 128)
    assert (got.layer_rows, got.head_rows, got.table) == (6, 2, plan.table)
    with pytest.raises(ValueError, match="not auto"):
        choose_product_plan(None, str(tmp_path / "missing.json"), 128)
    with pytest.raises(ValueError, match="kernels"):
        EngineConfig(kernels="fastest").check()


@needs_both
def test_plan_decides_which_kernel_serves_each_step_size() -> None:
    torch.manual_seed(0)
    lin = Linear(64, 96, True, torch.bfloat16)
    lin.weight.data.copy_(torch.randn(96, 64))
    lin.bias.data.copy_(torch.randn(96))
    lin.pack()
    limits = ProductPlan(4, 4, "C up to 4 rows").limits(kernels.decode_max_rows)
    for rows in (1, 4, 5, 32):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        want = (kernels.linear_decode(x, lin.decode_packed, lin.bias) if rows <= 4
                else packed_linear(x, lin.packed, lin.bias))
        product = plan_step(StepShape(rows, rows, rows, decode_only=True), limits, False).layers
        assert torch.equal(lin(x, product), want), rows


@pytest.fixture(scope="module")
def bf16_model(model_path):
    from splitserve.engine.model.loader import load_model

    return load_model(model_path, dtype=torch.bfloat16, engine=EngineConfig(kernels="c"))


@needs_both
def test_the_fused_layers_credit_tips_the_layers_crossover(bf16_model, monkeypatch) -> None:
    """The layers' C products bring the fused one-call path with them: the plan credits C
    with :data:`kernel_plan.FUSED_CREDIT_US` per layer where the model has fused layers and
    nothing where it has none. A credit larger than any timing makes C win every bucket; the
    table keeps the raw timings either way."""
    model, _ = bf16_model
    assert model.fused_layers is not None  # the Llama family's, packed for --kernels c
    monkeypatch.setattr(kernel_plan, "FUSED_CREDIT_US", 1e9)
    credited = kernel_plan.measure(model, 4)
    assert credited.layer_rows == 4
    assert credited.fused_credit_us == 1e9 * len(model.layers)
    assert all(t > 0 for row in credited.table for t in row[1:])
    assert ProductPlan.from_json(credited.to_json(), "x").fused_credit_us == \
        credited.fused_credit_us
    monkeypatch.setattr(model, "fused_decode", False)  # the per-op path only: no credit
    plain = kernel_plan.measure(model, 4)
    assert plain.fused_credit_us == 0.0


@needs_both
def test_auto_measures_once_per_machine_and_caches(bf16_model, tmp_path, monkeypatch) -> None:
    model, _ = bf16_model
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    calls = []
    real = kernel_plan.measure
    monkeypatch.setattr(kernel_plan, "measure", lambda m, r: calls.append(r) or real(m, r))
    monkeypatch.setattr(kernel_plan, "load_per_core", lambda: 0.2)  # a quiet machine
    first = choose_product_plan(model, "auto", 8)
    again = choose_product_plan(model, "auto", 8)
    assert calls == [8]  # the second start reads the cached choice
    assert (again.layer_rows, again.head_rows, again.table) == (
        first.layer_rows, first.head_rows, first.table)
    assert {r for r, *_ in first.table} <= {1, 2, 3, 4, 6, 8}
    assert all(t > 0 for row in first.table for t in row[1:])
    assert "cached" in again.source or "earlier" in again.source
    assert len(list((tmp_path / "kernel_plans").glob("*.json"))) == 1


@needs_both
def test_a_plan_timed_under_load_is_timed_again(bf16_model, tmp_path, monkeypatch) -> None:
    # Plans timed at load 5-14 per core once sent batch-1 steps to oneDNN for good.
    model, _ = bf16_model
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    calls: list[int] = []
    real = kernel_plan.measure
    monkeypatch.setattr(kernel_plan, "measure", lambda m, r: calls.append(r) or real(m, r))
    loads = iter([6.0, 9.0, 0.3, 0.1])
    monkeypatch.setattr(kernel_plan, "load_per_core", lambda: next(loads))
    first = choose_product_plan(model, "auto", 4)
    assert first.disturbed and first.load == 6.0
    second = choose_product_plan(model, "auto", 4)  # timed at 9.0: the cached 6.0 one is kept
    assert calls == [4, 4] and second.load == 6.0
    third = choose_product_plan(model, "auto", 4)  # timed at 0.3: replaces it
    assert calls == [4, 4, 4] and third.load == 0.3 and not third.disturbed
    fourth = choose_product_plan(model, "auto", 4)  # trusted from the cache now
    assert calls == [4, 4, 4] and fourth.load == 0.3 and "earlier" in fourth.source


def _generate(model, cfg, plan: ProductPlan) -> list[tuple[list[int], list[float]]]:
    model.set_product_plan(plan)
    model.attn_backend.decode_cache = None
    pool = KVPool(cfg.kv_layout(16, "bfloat16"), 96)
    core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=1024, max_running=4)
    g = torch.Generator().manual_seed(3)
    # One prefill step of > 128 rows (oneDNN under every plan), then decode steps of 4 rows.
    reqs = [Req(str(i), torch.randint(100, 40000, (150 + 7 * i,), generator=g).tolist(),
                SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
            for i in range(4)]
    for r in reqs:
        core.scheduler.add(r)
    while core.scheduler.has_work:
        core.step()
    return [(r.output_ids, r.output_logprobs) for r in reqs]


@needs_both
def test_a_chosen_path_gives_the_bits_of_the_forced_one(bf16_model) -> None:
    """Decode steps of 4 rows: a plan whose crossover is above 4 must equal forcing C, one below
    must equal forcing oneDNN, tokens and logprobs bit for bit (whatever the timing chose)."""
    model, cfg = bf16_model
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        forced_c = _generate(model, cfg, ProductPlan(128, 128, "c"))
        layers_onednn = _generate(model, cfg, ProductPlan(0, 128, "layers oneDNN"))
        head_onednn = _generate(model, cfg, ProductPlan(128, 0, "head oneDNN"))
        if kernels is not None and kernels.has_amx:
            # On AMX our tiles (gemm_amx.c) sum in oneDNN's order: every path gives the same
            # bits, so the choice cannot show in them (test_plan_decides_which_kernel_serves_
            # each_step_size checks it); what can fail here is that equality.
            assert forced_c == layers_onednn == head_onednn
            return
        # Each group's kernel changes the bits (so the equalities below can fail).
        assert forced_c != layers_onednn and forced_c != head_onednn
        assert _generate(model, cfg, ProductPlan(8, 8, "chose C at 4 rows")) == forced_c
        assert _generate(model, cfg, ProductPlan(2, 128, "chose oneDNN at 4 rows")) == layers_onednn
        assert _generate(model, cfg, ProductPlan(128, 3, "head oneDNN at 4 rows")) == head_onednn
    finally:
        torch.set_num_threads(before)
        model.set_product_plan(ProductPlan(128, 128, "c"))


@needs_both
def test_int4_plan_times_ours_against_torchs_int4_kernel(model_path, tmp_path,
                                                          monkeypatch) -> None:
    """``--quantization int4``: the measured plan has both int4 kernels' timings at every
    bucket it timed, and the plan's int4 crossover decides which one serves a step: a 4-row
    decode step under a plan that puts torch's kernel above 2 rows gives the bits of forcing
    torch's kernel, and those differ from ours (so the equality can fail)."""
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.model.quant_int4 import torch_int4_available

    if not torch_int4_available():
        pytest.skip("this torch has no CPU int4 kernel")  # torch's, not ours
    check_kernel(kernels, kernels is not None and kernels.has_w4, VNNI_KERNEL_FLAGS,
                 "int4 weight products (gemm_w4.c)")
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    model, cfg = load_model(model_path, dtype=torch.bfloat16,
                            engine=EngineConfig(kernels="c", quantization="int4"))
    plan = kernel_plan.measure(model, 4)
    assert [r for r, *_ in plan.w4_table] == [r for r, *_ in plan.table]
    assert all(t > 0 for row in plan.w4_table for t in row[1:])
    assert "int4" in plan.summary()
    assert ProductPlan.from_json(plan.to_json(), "x").w4_table == plan.w4_table
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours = _generate(model, cfg, ProductPlan(128, 128, "c"))
        torch4 = _generate(model, cfg, ProductPlan(128, 128, "c", (), 0))
        assert ours != torch4
        assert _generate(model, cfg, ProductPlan(128, 128, "c", (), 2)) == torch4
        assert _generate(model, cfg, ProductPlan(128, 128, "c", (), 8)) == ours
    finally:
        torch.set_num_threads(before)
