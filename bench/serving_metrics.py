"""Metrics of bench/serving.py runs: per-request records, SLOs, the run summary, the text table.

A run's summary (:func:`summarize`) gives counts, request/token throughputs, goodput (requests/s
meeting every SLO) and mean/p50/p90/p99 of TTFT, ITL, TPOT and end-to-end latency in ms.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from common import percentile

METRICS = ("ttft", "itl", "tpot", "e2e")
STATS = ("mean", "p50", "p90", "p99")
SLO_KINDS = ("ttft", "itl", "tpot", "e2e")  # itl: the request's largest gap


@dataclass(slots=True)
class RequestOutput:
    """A finished request. Times in seconds; ``start`` is relative to the run's start."""

    tag: str
    prompt_len: int
    start: float = 0.0
    ttft: float = float("nan")
    latency: float = float("nan")
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (NaN for a one-token output)."""
        if self.output_tokens < 2:
            return float("nan")
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_slos(items: list[str]) -> dict[str, float]:
    """``["ttft:2000", "itl:200"]`` -> ``{"ttft": 2.0, "itl": 0.2}`` (ms in, seconds out)."""
    slos: dict[str, float] = {}
    for item in items:
        kind, _, value = item.partition(":")
        if kind not in SLO_KINDS or not value:
            raise SystemExit(f"bad --slo {item!r}: use KIND:MS with KIND in {SLO_KINDS}")
        slos[kind] = float(value) / 1e3
    return slos


def meets_slos(out: RequestOutput, slos: dict[str, float]) -> bool:
    """Whether a finished request met every SLO (``itl``: its largest gap)."""
    if not out.ok:
        return False
    value = {
        "ttft": out.ttft,
        "e2e": out.latency,
        "tpot": out.tpot if out.output_tokens > 1 else 0.0,
        "itl": max(out.itls, default=0.0),
    }
    return all(value[k] <= limit for k, limit in slos.items())


def stats_ms(values: list[float]) -> dict[str, float]:
    vals = [v * 1e3 for v in values if not math.isnan(v)]
    if not vals:
        return {s: float("nan") for s in STATS}
    return {
        "mean": statistics.fmean(vals),
        "p50": percentile(vals, 50),
        "p90": percentile(vals, 90),
        "p99": percentile(vals, 99),
    }


def summarize(outs: list[RequestOutput], wall: float, slos: dict[str, float]) -> dict[str, Any]:
    """Aggregate one run: counts, throughputs, goodput and latency statistics (ms)."""
    ok = [o for o in outs if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_len for o in ok)
    good = sum(meets_slos(o, slos) for o in ok) if slos else len(ok)
    s: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "duration_s": wall,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": out_tokens / wall if wall else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / wall if wall else 0.0,
        "goodput": good / wall if wall else 0.0,
        "good_fraction": good / len(outs) if outs else 0,
        "slos_ms": {k: v * 1e3 for k, v in slos.items()},
        "errors": sorted({o.error for o in outs if o.error})[:3],
    }
    s["ttft_ms"] = stats_ms([o.ttft for o in ok])
    s["itl_ms"] = stats_ms([x for o in ok for x in o.itls])
    s["tpot_ms"] = stats_ms([o.tpot for o in ok])
    s["e2e_ms"] = stats_ms([o.latency for o in ok])
    return s


def print_summary(name: str, label: str, s: dict[str, Any]) -> None:
    def fmt(m: str) -> str:
        d = s[f"{m}_ms"]
        return f"{m.upper()} ms mean {d['mean']:.1f} p50 {d['p50']:.1f} p99 {d['p99']:.1f}"

    print(
        f"  {name} {label}: {s['output_throughput']:.1f} out tok/s, "
        f"{s['request_throughput']:.2f} req/s, goodput {s['goodput']:.2f} req/s "
        f"({s['good_fraction']:.0%}); {fmt('ttft')}; {fmt('itl')}; {fmt('tpot')}"
        + (f"; {s['failed']} FAILED: {s['errors']}" if s["failed"] else ""),
        flush=True,
    )


def print_table(runs: list[dict[str, Any]]) -> None:
    """One row per (target, load); ratios against the first target at the same load."""
    header = (
        f"{'target':<26}{'load':>8}{'out tok/s':>11}{'req/s':>8}{'goodput':>9}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'TPOT':>8}"
        f"{'x tok/s':>9}{'x TTFT':>8}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    base: dict[str, dict[str, Any]] = {}
    for r in runs:
        s = r["summary"]
        b = base.setdefault(r["load"], s)
        tok_ratio = s["output_throughput"] / b["output_throughput"] if b["output_throughput"] else 0
        ttft_ratio = s["ttft_ms"]["p50"] / b["ttft_ms"]["p50"] if b["ttft_ms"]["p50"] else 0
        print(
            f"{r['target']:<26}{r['load']:>8}{s['output_throughput']:>11.1f}"
            f"{s['request_throughput']:>8.2f}{s['goodput']:>9.2f}{s['ttft_ms']['p50']:>10.0f}"
            f"{s['ttft_ms']['p99']:>10.0f}{s['itl_ms']['p50']:>9.1f}{s['itl_ms']['p99']:>9.1f}"
            f"{s['tpot_ms']['mean']:>8.1f}{tok_ratio:>8.2f}x{ttft_ratio:>7.2f}x"
            + (f"  ({s['failed']} failed)" if s["failed"] else "")
        )
    print("ratios (x) are against the first target at the same load; goodput in req/s")
