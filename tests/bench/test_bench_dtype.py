"""Benchmarks launch what ``splitserve serve`` would: ``--dtype auto`` goes through
``common.resolve_bench_dtype``, which counts the C kernels as the CLI does (on an AVX2 CPU
``auto`` is bfloat16 only where they build; a bare ``resolve_dtype(name)`` says float32 there,
and the AVX2 figures of 2026-12-06 15:44 were float32 clusters for that reason)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_no_benchmark_resolves_the_dtype_without_the_kernels(script) -> None:
    text = (BENCH / script).read_text()
    if script == "common.py":
        assert "c_kernels=" in text
        return
    assert "resolve_dtype(" not in text.replace("resolve_bench_dtype(", ""), script


def test_auto_resolves_as_the_cli_does(monkeypatch) -> None:
    from splitserve.engine.kernels.cpu.build import load_cpu_kernels
    from splitserve.engine.kernels.cpu.features import resolve_dtype

    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("common", None)
    import common

    assert common.resolve_bench_dtype("auto") == resolve_dtype(
        "auto", "cpu", load_cpu_kernels() is not None)
    assert common.resolve_bench_dtype("float32")[0] == "float32"
    assert common.resolve_bench_dtype("bfloat16")[0] == "bfloat16"
