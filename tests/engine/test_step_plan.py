"""The step plan (``engine.step_plan``): the one decision of a step's path, over batch shapes,
kernel-plan limits and devices with no model (a table, then invariants over every shape); the
facts it reads from a forward batch; and, with the default model, that the path each step of the
real runner takes is the one its plan names (counted at the kernels' call sites), bit for bit
the same tokens as before."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.step_plan import (
    NO_LIMIT,
    GraphLimits,
    Product,
    ProductLimits,
    StepPlan,
    StepShape,
    plan_step,
    product_for,
)
from tests.cpu_kernels import BF16_KERNEL_FLAGS, check_kernel

C, TORCH, C_T4 = Product.C, Product.TORCH, Product.C_TORCH_INT4
CPU = ProductLimits(8, 4)  # a measured plan: layers C up to 8 rows, the head up to 4
CPU_INT4 = ProductLimits(8, 4, w4_layer_rows=2)  # int4: ours up to 2 rows, torch's above
NONE = ProductLimits()  # no C kernels packed: CUDA, float32, --disable-cpu-kernels
GRAPHS = GraphLimits(max_rows=8, max_pages=16, context_len=64)


def decode(rows: int, **kw) -> StepShape:
    """A decode step of ``rows`` sequences, every row sampled in order, keyed."""
    shape = StepShape(rows, rows, rows, decode_only=True, keyed=True, samples_in_order=True,
                      max_pages=4, max_seq_len=20)
    return dataclasses.replace(shape, **kw)


def verify(rows: int, tokens: int, **kw) -> StepShape:
    """A verify step: ``rows`` sequences, ``tokens`` new tokens (drafts included), a logit
    row per drafted position."""
    return decode(rows, num_tokens=tokens, num_logits=tokens, decode_only=tokens == rows,
                  verifies=True, samples_in_order=True, **kw)


def plan(as_decode_rows=False, replay_graph=False, fused_layers=False, layers=C, head=C):
    return StepPlan(as_decode_rows, replay_graph, fused_layers, layers, head)


TABLE = [
    # name, shape, limits, fuses, graphs, expected
    ("cpu bf16 decode, 1 row", decode(1), CPU, True, None, plan(fused_layers=True)),
    ("at the C limits", decode(8, num_logits=4), CPU, True, None, plan(fused_layers=True)),
    ("above the layers' C limit", decode(9), CPU, True, None, plan(layers=TORCH, head=TORCH)),
    ("head above its limit", decode(6), CPU, True, None, plan(fused_layers=True, head=TORCH)),
    ("fused layers switched off", decode(1), CPU, False, None, plan()),
    ("no sequence ids: no decode cache", decode(1, keyed=False), CPU, True, None, plan()),
    ("int4 at our kernel's rows", decode(2), CPU_INT4, True, None, plan(fused_layers=True)),
    ("int4 above them: torch's kernel, no fused loop", decode(3), CPU_INT4, True, None,
     plan(layers=C_T4)),
    ("a small prompt chunk", decode(1, num_tokens=3, decode_only=False), CPU, True, None,
     plan()),
    ("a prompt chunk that samples nothing",
     decode(1, num_tokens=30, num_logits=0, decode_only=False), CPU, True, None,
     plan(layers=TORCH, head=TORCH)),
    ("verify step the fused layers take", verify(1, 5), CPU, True, None,
     plan(as_decode_rows=True, fused_layers=True, head=TORCH)),
    ("verify rows and plain rows", verify(3, 6), CPU, True, None,
     plan(as_decode_rows=True, fused_layers=True, head=TORCH)),
    ("verify step above the layers' limit: an extend", verify(2, 9), CPU, True, None,
     plan(layers=TORCH, head=TORCH)),
    ("verify step without the fused layers: an extend", verify(1, 5), CPU, False, None,
     plan(head=TORCH)),
    ("verify step with int4 above ours: an extend", verify(1, 3), CPU_INT4, True, None,
     plan(layers=C_T4)),
    ("cuda decode in a captured size", decode(5), NONE, False, GRAPHS,
     plan(replay_graph=True, layers=TORCH, head=TORCH)),
    ("cuda decode above the captured sizes", decode(9), NONE, False, GRAPHS,
     plan(layers=TORCH, head=TORCH)),
    ("cuda decode not sampling every row in order", decode(4, samples_in_order=False), NONE,
     False, GRAPHS, plan(layers=TORCH, head=TORCH)),
    ("cuda prompt chunk", decode(2, num_tokens=7, decode_only=False), NONE, False, GRAPHS,
     plan(layers=TORCH, head=TORCH)),
    ("cuda decode past the page table", decode(2, max_pages=17), NONE, False, GRAPHS,
     plan(layers=TORCH, head=TORCH)),
    ("cuda decode past the context", decode(2, max_seq_len=65), NONE, False, GRAPHS,
     plan(layers=TORCH, head=TORCH)),
    ("cuda verify step: an extend, never a graph", verify(1, 4), NONE, False, GRAPHS,
     plan(layers=TORCH, head=TORCH)),
    ("cpu without C kernels", decode(1), NONE, False, None, plan(layers=TORCH, head=TORCH)),
]


@pytest.mark.parametrize(("shape", "limits", "fuses", "graphs", "want"),
                         [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_plan_table(shape, limits, fuses, graphs, want) -> None:
    assert plan_step(shape, limits, fuses, graphs) == want


def test_product_for_is_one_threshold_per_group() -> None:
    assert [product_for(n, 4) for n in (0, 1, 4, 5)] == [TORCH, C, C, TORCH]
    assert [product_for(n, 8, 2) for n in (1, 2, 3, 8, 9)] == [C, C, C_T4, C_T4, TORCH]
    assert product_for(1, 0) is TORCH and product_for(NO_LIMIT, NO_LIMIT) is C


shapes = st.builds(
    StepShape, num_rows=st.integers(1, 12), num_tokens=st.integers(1, 40),
    num_logits=st.integers(0, 40), decode_only=st.booleans(), keyed=st.booleans(),
    verifies=st.booleans(), samples_in_order=st.booleans(), max_pages=st.integers(1, 20),
    max_seq_len=st.integers(1, 80),
)
limits = st.builds(ProductLimits, st.integers(0, 16), st.integers(0, 16),
                   st.sampled_from([0, 2, 8, NO_LIMIT]))


@given(shapes, limits, st.booleans(), st.none() | st.just(GRAPHS))
def test_plan_invariants(shape, lim, fuses, graphs) -> None:
    """What must hold of every plan, whatever the shape: the fused layers only where they serve
    and every product is one of ours (they have no torch kernel); decode rows only for a verify
    step the fused layers then take; a graph only where there are graphs, never for decode rows
    or a prompt chunk; no C product past its limit."""
    p = plan_step(shape, lim, fuses, graphs)
    if p.fused_layers:
        assert fuses and shape.keyed and p.layers is C
        assert shape.decode_only or p.as_decode_rows
    if p.as_decode_rows:
        assert shape.verifies and p.fused_layers
    if p.replay_graph:
        assert graphs is not None and not p.as_decode_rows and shape.decode_only
        assert shape.samples_in_order and shape.num_rows <= graphs.max_rows
    if p.layers is not TORCH:
        assert shape.num_tokens <= lim.layer_rows
    if p.head is not TORCH:
        assert 0 < shape.num_logits <= lim.head_rows
    assert (p.layers is C_T4) == (lim.w4_layer_rows < shape.num_tokens <= lim.layer_rows)


def test_shape_of_a_forward_batch() -> None:
    """The facts :meth:`StepShape.of` reads: rows, tokens, scored positions, decode-only,
    keyed, in-order sampling (not with prompt logprobs), page-table width, longest sequence."""
    pages = [[1, 2], [3], [4, 5, 6]]
    b = build_forward_batch([[7], [8], [9]], [5, 2, 9], pages, 4, [0, 1, 2], seq_ids=[3, 4, 5])
    assert StepShape.of(b, [0, 1, 2]) == StepShape(3, 3, 3, True, True, False, True, 3, 10)
    assert not StepShape.of(b, [0, 2]).samples_in_order
    assert not StepShape.of(b, [0, 1, 2], [1]).samples_in_order
    assert not StepShape.of(b).samples_in_order  # not a scheduled step
    prompt = build_forward_batch([[7, 8, 9], [1]], [0, 3], pages[:2], 4, [1])
    shape = StepShape.of(prompt, [1], verifies=False)
    assert (shape.num_tokens, shape.num_logits, shape.decode_only, shape.keyed) == (
        4, 1, False, False)


# ---- the real runner follows its plans ---------------------------------------------------------


def _load(model_path, quantization: str):
    """The default model in bfloat16, its C kernels packed, or a skip without a C compiler."""
    from splitserve.config import EngineConfig
    from splitserve.engine.model.loader import load_model
    from tests.cpu_kernels import load_or_fail

    if load_or_fail() is None:
        pytest.skip("no C compiler")
    engine = EngineConfig(kernels="c", quantization=quantization)
    return load_model(model_path, dtype=torch.bfloat16, engine=engine)


@pytest.fixture(scope="module")
def bf16_model(model_path):
    return _load(model_path, "none")


class PathCounter:
    """Counts each kernel call site of one step: the fused layers (runs), the layers' C products,
    torch's int4 kernel, oneDNN's products (layers and head together), the head's C product."""

    def __init__(self, monkeypatch) -> None:
        from splitserve.engine.model import layers
        from splitserve.engine.model.fused_decode import FusedDecodeLayers
        from splitserve.engine.runner.model_runner import ModelRunner

        self.plans: list[tuple[StepPlan, int]] = []  # each step's plan and scored positions
        self.steps: list[dict[str, int]] = []
        self.now: dict[str, int] = {}
        count = self._count

        def spy(kind, fn, result=None):
            def wrapped(*args, **kwargs):
                out = fn(*args, **kwargs)
                if result is None or result(out):
                    count(kind)
                return out
            return wrapped

        real_plan = ModelRunner.plan_step

        def plan(runner, step, batch):
            p = real_plan(runner, step, batch)
            self.plans.append((p, len(batch.logit_indices)))
            self.now = dict.fromkeys(("fused", "c", "torch_int4", "onednn", "head_c"), 0)
            self.steps.append(self.now)
            return p

        monkeypatch.setattr(ModelRunner, "plan_step", plan)
        monkeypatch.setattr(FusedDecodeLayers, "run",
                            spy("fused", FusedDecodeLayers.run, result=bool))
        monkeypatch.setattr(layers.Linear, "c_product", spy("c", layers.Linear.c_product))
        monkeypatch.setattr(layers, "torch_int4_mm", spy("torch_int4", layers.torch_int4_mm))
        monkeypatch.setattr(layers, "packed_linear", spy("onednn", layers.packed_linear))
        monkeypatch.setattr(layers.LMHead, "c_product", spy("head_c", layers.LMHead.c_product))

    def _count(self, kind: str) -> None:
        self.now[kind] += 1

    @staticmethod
    def expected(p: StepPlan, num_linears: int, num_logits: int) -> dict[str, int]:
        """The calls ``p`` implies: the fused layers hold every layer product; else each
        projection once by its plan's kernel; the head once by its own (not at all when the
        step scores nothing)."""
        sampled = num_logits > 0
        layers_c = 0 if p.fused_layers or p.layers is TORCH else num_linears
        return {
            "fused": int(p.fused_layers),
            "c": layers_c,
            "torch_int4": layers_c if p.layers is C_T4 else 0,
            "onednn": (num_linears if p.layers is TORCH and not p.fused_layers else 0)
            + int(sampled and p.head is TORCH),
            "head_c": int(sampled and p.head is C),
        }


def _run_steps(model, cfg, speculative: bool):
    from splitserve.engine.kv_pool import KVPool
    from splitserve.engine.sched.request import Req
    from splitserve.ipc.messages import SamplingParams
    from tests.engine_core import make_core

    model.attn_backend.decode_cache = None
    pool = KVPool(cfg.kv_layout(16, "bfloat16"), 96)
    engine = {"speculative": "ngram", "num_speculative_tokens": 3} if speculative else {}
    core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=64, max_running=6,
                     **engine)
    g = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(1 if speculative else 6):
        # A repeated phrase gives the n-gram drafter something to propose.
        ids = torch.randint(100, 40000, (4 + 3 * i,), generator=g).tolist() * 4
        max_new = 12 if speculative else 3 + 2 * i
        reqs.append(Req(str(i), ids, SamplingParams(temperature=0.0, max_new_tokens=max_new,
                                                    ignore_eos=True)))
        core.scheduler.add(reqs[-1])
    while core.scheduler.has_work:
        core.step()
    return [(r.output_ids, r.output_logprobs) for r in reqs]


def _check_paths(model, cfg, monkeypatch, plan, speculative: bool = False) -> set[tuple]:
    """Run the steps under ``plan``; assert each step's kernel calls are its plan's; returns
    the plans' ``(fused_layers, layers, head, as_decode_rows)`` kinds."""
    from splitserve.engine.model.kernel_plan import ProductPlan
    from splitserve.engine.model.layers import Linear

    num_linears = sum(isinstance(m, Linear) for m in model.layers.modules())
    model.set_product_plan(plan)
    try:
        counter = PathCounter(monkeypatch)
        _run_steps(model, cfg, speculative)
    finally:
        model.set_product_plan(ProductPlan(128, 128, "forced: --kernels c"))
    assert counter.plans
    for (p, num_logits), got in zip(counter.plans, counter.steps, strict=True):
        assert got == counter.expected(p, num_linears, num_logits), p
    return {(p.fused_layers, p.layers, p.head, p.as_decode_rows) for p, _ in counter.plans}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("speculative", [False, True])
def test_each_step_takes_the_path_its_plan_names(bf16_model, monkeypatch, speculative) -> None:
    """Decode steps of 6 down to 1 rows (and prompt steps) under a plan with C products up to 4
    rows in the layers and 2 in the head: every step's kernel calls are the ones its plan
    implies, so the plan is what ran; the plans cover fused steps with the head in C and in
    oneDNN, and oneDNN steps; or (speculative, one sequence) verify steps as decode rows."""
    from splitserve.engine.model.kernel_plan import ProductPlan

    model, cfg = bf16_model
    check_kernel(model.kernels, model.kernels is not None and model.kernels.decode_max_rows >= 4,
                 BF16_KERNEL_FLAGS, "the C products at 4 rows (AVX512_BF16 tiles)")
    plan = ProductPlan(4, 2, "test: C up to 4 rows, head up to 2")
    kinds = _check_paths(model, cfg, monkeypatch, plan, speculative)
    if speculative:
        assert any(fused and rows for fused, _, _, rows in kinds)
        return
    assert (True, C, C, False) in kinds  # 1-2 row decode steps
    assert (True, C, TORCH, False) in kinds  # 3-4 rows: the head above its limit
    assert (False, TORCH, TORCH, False) in kinds  # prompt steps and 5-6 row decode steps


@pytest.mark.usefixtures("one_thread")
def test_int4_steps_take_torchs_kernel_where_planned(model_path, monkeypatch) -> None:
    """``--quantization int4`` with our int4 kernel up to 1 row and torch's above: 1-row decode
    steps run the fused layers, 2-4 row steps the per-op path with torch's int4 kernel for
    every projection, as their plans say."""
    from splitserve.engine.model.kernel_plan import ProductPlan
    from splitserve.engine.model.quant_int4 import torch_int4_available
    from tests.cpu_kernels import VNNI_KERNEL_FLAGS, check_kernel, load_or_fail

    kernels = load_or_fail()
    if not torch_int4_available():
        pytest.skip("this torch has no CPU int4 kernel")  # torch's, not ours
    check_kernel(kernels, kernels is not None and kernels.has_w4, VNNI_KERNEL_FLAGS,
                 "int4 weight products (gemm_w4.c)")
    model, cfg = _load(model_path, "int4")
    plan = ProductPlan(4, 2, "test: int4 ours at 1 row", w4_layer_rows=1)
    kinds = _check_paths(model, cfg, monkeypatch, plan)
    assert (True, C, C, False) in kinds
    assert (False, C_T4, C, False) in kinds and (False, C_T4, TORCH, False) in kinds
