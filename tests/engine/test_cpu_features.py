"""dtype auto-detection and the launcher's CPU-affinity parsing (no processes started)."""

from __future__ import annotations

import pytest

from splitserve.config.flags import parse_cpu_affinity
from splitserve.engine.kernels.cpu import features as cpu_features
from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config


def test_resolve_dtype(monkeypatch) -> None:
    assert cpu_features.resolve_dtype("float32") == ("float32", "asked for")
    assert cpu_features.resolve_dtype("auto", "cuda:0")[0] == "bfloat16"
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert cpu_features.resolve_dtype("auto") == ("bfloat16", "auto: CPU has avx512_bf16")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2"}))
    assert cpu_features.resolve_dtype("auto")[0] == "float32"
    # AVX2 and FMA: bfloat16 only where our C kernels serve it (gemv.c's AVX2 block).
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cpu_features.resolve_dtype("auto")[0] == "float32"
    assert cpu_features.resolve_dtype("auto", c_kernels=True) == (
        "bfloat16", "auto: CPU has avx2 and fma, and the C kernels serve bfloat16 there")
    assert cpu_features.resolve_dtype("float32", c_kernels=True)[0] == "float32"
    # AVX-512 without BF16 (oneDNN packs and emulates bf16 there): not measured, float32.
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert cpu_features.resolve_dtype("auto", c_kernels=True)[0] == "float32"
    with pytest.raises(ValueError, match="unknown dtype"):
        cpu_features.resolve_dtype("float16")


def test_parse_cpu_affinity() -> None:
    assert parse_cpu_affinity("prefill=0 decode=1") == {"prefill": [0], "decode": [1]}
    assert parse_cpu_affinity(["colocated=0-2,5"]) == {"colocated": [0, 1, 2, 5]}
    for bad in ("prefill", "decode=", "decode=a", "=1"):
        with pytest.raises(ValueError):
            parse_cpu_affinity(bad)


def test_affinity_lookup_by_worker_id_then_role() -> None:
    spec = serve_config("m", cpu_affinity={"decode": [1], "decode-2": [3], "api-server": [0]})
    cluster = Cluster(spec)
    assert cluster._cpus("decode-1") == [1]
    assert cluster._cpus("decode-2") == [3]
    assert cluster._cpus("prefill-0") is None
    assert cluster._cpus("api-server") == [0]


def test_the_cpu_line_names_family_model_cores_and_the_kernel_flags(monkeypatch) -> None:
    """The line benchmarks and the test log print: the model name alone ("AMD EPYC") does not
    tell Zen 3 from Zen 4, so the family and model numbers follow; of the flags, only those
    that decide our kernels, in ``KERNEL_FLAGS`` order."""
    monkeypatch.setattr(cpu_features, "_cpuinfo_fields", lambda: {
        "model name": "AMD EPYC", "cpu family": "25", "model": "17"})
    monkeypatch.setattr(cpu_features, "cpu_flags",
                        lambda: frozenset({"fma", "avx512f", "sse2", "avx2", "avx512_bf16"}))
    line = cpu_features.cpu_line()
    assert line.startswith("AMD EPYC family 25 model 17, ") and " cores " in line, line
    assert line.endswith("(avx2, avx512f, avx512_bf16)"), line
    monkeypatch.setattr(cpu_features, "_cpuinfo_fields", dict)  # no /proc/cpuinfo
    monkeypatch.setattr(cpu_features, "cpu_flags", frozenset)
    assert cpu_features.cpu_line().startswith("unknown CPU, ")
