"""Which kernel runs a decode step's matrix products, chosen by timing them on this machine.

Our C products (``gemv.c`` at 1-2 rows, the AVX512-BF16 register tiles of ``gemm_bf16.c`` from
3 rows, the AMX tiles of ``gemm_amx.c`` at every row count where the CPU has them; int8 weights:
``gemm_w8.c``) beat oneDNN on CPUs without AMX (Zen 4: 1.7-2x at 4-8 rows, 1.2x at 32); on
Sapphire/Emerald Rapids the AVX-512 tiles lost to oneDNN's AMX kernels from a few rows on
(3.7x slower at 32 rows) until ours ran on AMX too. Nothing but a measurement tells which
machine one is on, so at start-up the worker times both on the model's own packed weights,
every layer's in turn as a step reads them (one layer's timed again and again sits in the
cache, which flatters the kernel that reads more bytes: oneDNN's bfloat16 copy against the int8
weights, measured 1.4x off at 32 rows on the AMX Xeon), at the row counts a decode step can
have, and keeps the C products for steps of at most :attr:`ProductPlan.layer_rows` rows (the decoder
layers' products, and the fused one-call decode path, which uses them) and
:attr:`ProductPlan.head_rows` rows (the vocab projection): the row limits
(:meth:`ProductPlan.limits`) by which the step planner, ``engine.step_plan``, picks each step's
products. The C attention, norms and RoPE kernels are used wherever they apply either way: they
beat torch on every CPU measured.

The choice is cached per CPU model, CPU flags, torch version, thread count, C library build and
product shapes under ``$SPLITSERVE_CACHE/kernel_plans/``, so the timing (about a second for the
default model) runs once per machine. A plan is stored with the machine's load average when it
was timed: one timed on an oversubscribed machine (load above :data:`DISTURBED` per core) is
used for that run but timed again at the next start, and the less disturbed of the two is kept
(a C product whose threads were descheduled reads 100x slower, and such a plan once sent every
batch-1 step to oneDNN at 1.75x the cost, for good). ``EngineConfig.kernels`` (``--kernels``) forces it:
``auto`` (measure), ``c`` (C products up to the tiles' limit, 128 rows), ``torch`` (oneDNN for
every product), or the path of a plan file written by an earlier run.

Under ``--quantization int4`` the decoder layers' C products have two kernels, ours
(``gemm_w4.c``) and torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``), timed against each
other at every bucket as well: ours serves steps of at most :attr:`ProductPlan.w4_layer_rows`
rows, torch's above, and the oneDNN crossover is taken on the faster of the two. (The LM head
stays at int8 under int4: ``DecoderLM.quantize_weights``.)

Following oneDNN's and Triton's practice of choosing a kernel by timing it on the machine at
hand (Triton's ``autotune``), with the decision rule kept to one crossover per product group
because the dispatch is a threshold.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from splitserve.config import env
from splitserve.engine.model.layers import Linear, packed_linear
from splitserve.engine.model.quant_int4 import torch_int4_mm
from splitserve.engine.step_plan import NO_LIMIT, ProductLimits

logger = logging.getLogger(__name__)

# Row counts a decode step is timed at (the scheduler's steps have any count up to max_running).
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
REPEATS = 5  # timed calls per (bucket, kernel), each a whole step's products; the fastest is kept
PLAN_VERSION = 2  # in the cache key: 2 times every layer's weights and credits the fused path
KERNEL_CHOICES = ("auto", "c", "torch")  # or a plan file's path


@dataclass(frozen=True, slots=True)
class ProductPlan:
    """C products for decode steps of at most ``layer_rows`` rows in the decoder layers and
    ``head_rows`` in the vocab projection; oneDNN above (0: never C). ``table``: the timings
    it came from, ``(rows, layers C, layers oneDNN, head C, head oneDNN)`` in microseconds per
    step (every layer's products), empty when forced. ``fused_credit_us``: what C products
    were credited per step against oneDNN in the layers' comparison (:data:`FUSED_CREDIT_US`
    per layer where the model has fused decode layers). ``source`` says where it came from."""

    layer_rows: int
    head_rows: int
    source: str
    table: tuple[tuple[int, float, float, float, float], ...] = ()
    # int4 only: the layers take ours up to these rows, torch's int4 kernel above; w4_table:
    # (rows, layers ours, layers torch int4) in microseconds.
    w4_layer_rows: int = NO_LIMIT
    w4_table: tuple[tuple[int, float, float], ...] = ()
    load: float = 0.0  # 1-minute load average per usable core when timed (0: not timed)
    fused_credit_us: float = 0.0

    @property
    def disturbed(self) -> bool:
        """True when timed on an oversubscribed machine: not to be trusted from the cache."""
        return self.load > DISTURBED

    def summary(self) -> str:
        text = (f"C products for decode steps of <= {self.layer_rows} rows (LM head <= "
                f"{self.head_rows}), oneDNN above ({self.source})")
        if self.w4_table:
            if self.w4_layer_rows >= NO_LIMIT:
                text += "; int4: ours at every timed size (faster than torch's int4 kernel)"
            else:
                text += f"; int4: ours <= {self.w4_layer_rows} rows, torch's int4 kernel above"
        return text

    def lines(self) -> list[str]:
        """The summary, then one line per timed bucket."""
        out = [self.summary()]
        for rows, lc, lo, hc, ho in self.table:
            out.append(f"  {rows:4d} rows: layers C {lc / 1e3:7.2f} ms, oneDNN {lo / 1e3:7.2f} ms; "
                       f"head C {hc / 1e3:6.2f} ms, oneDNN {ho / 1e3:6.2f} ms")
        for rows, lc, lt in self.w4_table:
            out.append(f"  {rows:4d} rows int4: layers ours {lc / 1e3:7.2f} ms, torch "
                       f"{lt / 1e3:7.2f} ms")
        return out

    def limits(self, max_rows: int) -> ProductLimits:
        """The step planner's row limits (``engine.step_plan``) under this plan, where the C
        products take at most ``max_rows`` rows (the kernels' limit on this CPU)."""
        return ProductLimits(min(self.layer_rows, max_rows), min(self.head_rows, max_rows),
                             self.w4_layer_rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str) -> ProductPlan:
        """Raises: ValueError: not a plan."""
        try:
            d = json.loads(text)
            table = tuple(tuple(row) for row in d.get("table", ()))
            # A file written before the head kept int8 under int4 has two head columns more.
            w4 = tuple(tuple(row[:3]) for row in d.get("w4_table", ()))
            return cls(int(d["layer_rows"]), int(d["head_rows"]), source, table,  # type: ignore[arg-type]
                       int(d.get("w4_layer_rows", NO_LIMIT)), w4,  # type: ignore[arg-type]
                       load=float(d.get("load", 0.0)),
                       fused_credit_us=float(d.get("fused_credit_us", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a kernel plan: {exc}") from exc


TIE = 1.05  # C within 5% of oneDNN counts as a win: the fused one-call path needs C products
# What the fused one-call decode layers save per layer and step against the per-op path (its
# ~10 Python-level calls, allocations and ctypes calls per layer), credited to the C column of
# the decoder layers when the model has fused layers: measured on the AMX Xeon (family 6
# model 167, 2 threads) as 210-250 us per layer at batch 32-48 (``bench/quant_decode_step.py
# --configs int8 int8:unfused``: 31.9 vs 38.3 ms over 30 layers); taken lower so that only a
# near tie tips. With it the plan's crossovers there match the whole step's (C up to ~12 rows
# in bfloat16, ~32-48 with int8 weights).
FUSED_CREDIT_US = 150.0
# Load average per core above which a timing is not trusted from the cache. Plans timed at 5-14
# per core (eight jobs on two cores) were off by 100x; the load a launch itself makes (its other
# workers starting) stays near 1 per core.
DISTURBED = 1.5


def load_per_core() -> float:
    """Returns: the 1-minute load average divided by the cores this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
        return os.getloadavg()[0] / max(1, cores)
    except (AttributeError, OSError):
        return 0.0


def crossover(c_us: list[float], onednn_us: list[float], buckets: tuple[int, ...]) -> int:
    """The largest bucket up to which C is within :data:`TIE` of oneDNN at every measured
    bucket (0 when it loses at the first): the dispatch is one threshold, so a later win after
    a loss does not count."""
    rows = 0
    for b, c, o in zip(buckets, c_us, onednn_us):
        if c > o * TIE:
            break
        rows = b
    return rows


def _best_pair_us(a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """The fastest of :data:`REPEATS` calls of each, in microseconds, alternating ``a`` and
    ``b`` so that both see the same machine: on a shared machine a slow call is interference,
    never the kernel, so the minimum is the estimate (as ``timeit`` recommends)."""
    a(), b()  # warm: first-touch allocations, oneDNN's primitive cache
    ta, tb = [], []
    for _ in range(REPEATS):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(ta) * 1e6, min(tb) * 1e6


def measure(model: torch.nn.Module, max_rows: int) -> ProductPlan:
    """Time every decoder layer's products (each layer's own weights, in order, as a step
    reads them) and the LM head, C against oneDNN, at each bucket up to ``max_rows``, on the
    model's packed weights, with the current torch thread count; the C column of the layers is
    credited :data:`FUSED_CREDIT_US` per layer where the model has fused decode layers (which
    run only on C products). Stops once C has lost at two buckets in a row for both groups."""
    layers = [[m for m in layer.modules() if isinstance(m, Linear)]
              for layer in model.layers]  # type: ignore[attr-defined]
    credit = FUSED_CREDIT_US * len(layers) if _has_fused_layers(model) else 0.0
    head = model.head  # type: ignore[attr-defined]
    buckets = tuple(b for b in BUCKETS if b <= max_rows)
    gen = torch.Generator().manual_seed(0)
    int4 = all(m.int4 is not None and m.int4.torch_packed is not None for m in layers[0])
    table, w4_table, fairs = [], [], []
    losses = 0
    for rows in buckets:
        xs = [torch.randn(rows, m.weight.shape[1], generator=gen).bfloat16() for m in layers[0]]
        h = torch.randn(rows, head.weight.shape[1], generator=gen).bfloat16()

        def layer_c(xs=xs) -> None:
            for layer in layers:
                for m, x in zip(layer, xs):
                    m.c_product(x)  # bfloat16 or int8 weights (--quantization)

        def layer_onednn(xs=xs) -> None:
            for layer in layers:
                for m, x in zip(layer, xs):
                    packed_linear(x, m.packed, m.bias)

        lc, lo = _best_pair_us(layer_c, layer_onednn)
        fair = lc - credit  # what C costs the step against oneDNN's per-op path
        hc, ho = _best_pair_us(lambda h=h: head.c_product(h),
                               lambda h=h: packed_linear(h, head.packed, None))
        if int4:  # c_product ran ours (Product.C); now ours against torch's int4 kernel

            def layer_t4(xs=xs) -> None:
                for layer in layers:
                    for m, x in zip(layer, xs):
                        torch_int4_mm(x, m.int4.torch_packed, m.int4.torch_sz, m.bias)

            l4, lt = _best_pair_us(layer_c, layer_t4)  # ours fuses, torch's int4 kernel not
            w4_table.append((rows, l4, lt))
            lc = min(lc, lt)  # the layers' C column: the faster int4 kernel (the head is int8)
            fair = min(l4 - credit, lt)  # ours fuses, torch's int4 kernel does not
        table.append((rows, lc, lo, hc, ho))
        fairs.append(fair)
        losses = losses + 1 if (fair > lo * TIE and hc > ho * TIE) else 0
        if losses == 2:
            break
    timed = tuple(r for r, *_ in table)
    layer_rows = crossover(fairs, [t[2] for t in table], timed)
    head_rows = crossover([t[3] for t in table], [t[4] for t in table], timed)
    if not int4:
        return ProductPlan(layer_rows, head_rows, "measured", tuple(table),
                           fused_credit_us=credit)
    # Ours fuses, torch's int4 kernel does not: ours is credited against it as well.
    w4_layer = crossover([t[1] - credit for t in w4_table], [t[2] for t in w4_table], timed)
    return ProductPlan(layer_rows, head_rows, "measured", tuple(table),
                       NO_LIMIT if w4_layer == timed[-1] else w4_layer, tuple(w4_table),
                       fused_credit_us=credit)


def _has_fused_layers(model: torch.nn.Module) -> bool:
    """Whether C products bring the fused one-call decode layers with them: switched on and
    offered by the family (built once packed); the attention backend is not known here."""
    return bool(getattr(model, "fused_decode", False)) and \
        getattr(model, "fused_layers", None) is not None


def _cache_key(model: torch.nn.Module, max_rows: int) -> str:
    """What the timings depend on: the CPU, torch, threads, the C build and the shapes."""
    cpu = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            cpu = b"".join(line for line in f if line.startswith((b"model name", b"flags")))
    except OSError:
        pass
    # The shapes, and whether the C products read int8 weights (--quantization int8).
    shapes = [((m.out_features, m.in_features), m.int8 is not None, m.int4 is not None)
              for m in model.layers[0].modules() if isinstance(m, Linear)]  # type: ignore[attr-defined]
    head = model.head  # type: ignore[attr-defined]
    shapes.append(((head.out_features, head.in_features), head.int8 is not None))
    parts = [cpu.decode(errors="replace"), torch.__version__, str(torch.get_num_threads()),
             str(getattr(model.head.kernels, "library_path", "")), str(shapes),  # type: ignore[attr-defined]
             str((model.head.out_features, model.head.in_features)),  # type: ignore[attr-defined]
             str(model.head.int8 is not None),  # type: ignore[attr-defined]
             str(len(model.layers)), str(max_rows), f"plan v{PLAN_VERSION}",
             str(_has_fused_layers(model))]  # type: ignore[attr-defined]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def choose_product_plan(model: torch.nn.Module, choice: str, max_rows: int) -> ProductPlan:
    """The plan for ``model`` (packed for the C kernels and oneDNN) under ``choice``
    (:data:`KERNEL_CHOICES` or a plan file). ``max_rows``: the C products' limit on this CPU.

    Raises:
        ValueError: a ``choice`` that is neither a known name nor a readable plan file.
    """
    if choice == "c":
        return ProductPlan(max_rows, max_rows, "forced: --kernels c")
    if choice == "torch":
        return ProductPlan(0, 0, "forced: --kernels torch")
    if choice != "auto":
        path = Path(choice)
        try:
            return ProductPlan.from_json(path.read_text(), f"file {path}")
        except OSError as exc:
            raise ValueError(f"--kernels {choice}: not auto|c|torch and not a readable plan "
                             f"file ({exc})") from exc
    cached = env.cache_dir() / "kernel_plans" / f"{_cache_key(model, max_rows)}.json"
    earlier = None
    if cached.exists():
        try:
            earlier = ProductPlan.from_json(cached.read_text(), f"measured earlier, {cached}")
        except ValueError:
            pass  # a torn or foreign file: measure again
    if earlier is not None and not earlier.disturbed:
        return earlier
    load = load_per_core()
    t0 = time.perf_counter()
    plan = measure(model, max_rows)
    took = time.perf_counter() - t0
    plan = replace(plan, source=f"measured in {took:.1f} s at load {load:.1f} per core", load=load)
    if earlier is not None and earlier.load <= load:
        plan = earlier  # the cached timing was the less disturbed one
    else:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=cached.parent)
        with os.fdopen(fd, "w") as f:
            f.write(plan.to_json())
        os.replace(tmp, cached)  # atomic: workers starting together may race
    if plan.disturbed:
        logger.warning("kernel choice timed at load %.1f per core (> %.1f): it will be timed "
                       "again at the next start", plan.load, DISTURBED)
    # One line at the default level (a measured plan is news once per machine); the timings
    # per step size, 15 lines, only at --log-level info.
    summary, *buckets = plan.lines()
    logger.warning("kernel choice: %s", summary)
    for line in buckets:
        logger.info("kernel choice: %s", line)
    return plan
