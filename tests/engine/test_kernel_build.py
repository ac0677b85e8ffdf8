"""The C kernel build never fails silently: a compiler that errors or hangs gives a failed
build naming the cause (logged at error level, shown by the worker), distinct from a machine
with no compiler, and the kernel tests fail on the former where they skip on the latter."""

from __future__ import annotations

import logging
import stat

import pytest

from splitserve.engine.kernels.cpu import build
from splitserve.engine.kernels.cpu.build import FAILED, NO_COMPILER, KernelBuild, build_kernels
from tests.cpu_kernels import load_or_fail


def fake_compiler(tmp_path, body: str) -> str:
    path = tmp_path / "fake-cc"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_failing_compiler_is_a_failed_build_naming_the_cause(tmp_path, caplog) -> None:
    cc = fake_compiler(tmp_path, 'echo "fake-cc: error: no such instruction" >&2; exit 1')
    with caplog.at_level(logging.ERROR):
        got = build_kernels(cc, tmp_path / "cache")
    assert got.kernels is None and got.state == FAILED and got.failed
    assert "compiling decode_attention.c failed (exit 1)" in got.detail
    assert "no such instruction" in got.detail
    assert "BUILD FAILED" in got.describe() and cc in got.describe()
    assert any(
        r.levelno == logging.ERROR and "no such instruction" in r.getMessage()
        for r in caplog.records
    )


def test_hanging_compiler_times_out_as_a_failed_build(tmp_path) -> None:
    cc = fake_compiler(tmp_path, "exec sleep 60")
    got = build_kernels(cc, tmp_path / "cache", timeout_s=0.5)
    assert got.state == FAILED
    assert "compiling decode_attention.c timed out after 0.5 s" in got.detail


def test_compiler_output_that_does_not_load_is_a_failed_build(tmp_path) -> None:
    # "Compiles" every file and links an empty file: loading it fails.
    cc = fake_compiler(tmp_path, 'while [ "$1" != "-o" ]; do shift; done; : > "$2"')
    got = build_kernels(cc, tmp_path / "cache")
    assert got.state == FAILED and "libsplitserve_cpu.so" in got.detail


def test_no_compiler_is_not_a_failure(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        got = build_kernels(None, tmp_path / "cache")
    assert got.state == NO_COMPILER and not got.failed and got.kernels is None
    assert "no C compiler" in got.describe()
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)


def test_cc_is_read_through_config_env(monkeypatch) -> None:
    monkeypatch.setenv("CC", "/opt/cc-from-env")
    assert build.find_compiler() == "/opt/cc-from-env"


def test_kernel_tests_fail_on_a_failed_build_and_skip_without_compiler(monkeypatch) -> None:
    import tests.cpu_kernels as helper

    monkeypatch.setattr(helper, "cpu_kernel_build", lambda: KernelBuild(None, FAILED, "cc: boom"))
    with pytest.raises(pytest.fail.Exception, match="BUILD FAILED \\(cc: boom\\)"):
        load_or_fail()
    monkeypatch.setattr(helper, "cpu_kernel_build", lambda: KernelBuild(None, NO_COMPILER))
    assert load_or_fail() is None


def test_worker_reports_a_failed_build(model_path, monkeypatch, caplog) -> None:
    """A worker whose C kernels failed to build still serves (torch ops) and says so: at error
    level on start-up, and in ``WorkerStats.kernel_plan`` (``GET /workers``)."""
    import splitserve.worker.build as worker_build
    from splitserve.worker.main import create_worker
    from tests.cluster_config import worker_config

    failed = KernelBuild(None, FAILED, "fake-cc: compiling gemv.c timed out after 900 s")
    monkeypatch.setattr(build, "cpu_kernel_build", lambda: failed)  # the engine's layers
    monkeypatch.setattr(worker_build, "cpu_kernel_build", lambda: failed)
    with caplog.at_level(logging.ERROR):
        worker = create_worker(
            worker_config(
                model_path,
                "colocated",
                "tcp://127.0.0.1:1",
                kv_cache_mb=8,
                dtype="bfloat16",
                cpu_kernels=True,
            )
        )
    try:
        assert worker.runner.model.kernels is None  # torch ops serve
        plan = worker.stats().kernel_plan
        assert "BUILD FAILED" in plan and "gemv.c timed out" in plan
        assert any(
            r.levelno == logging.ERROR and "BUILD FAILED" in r.getMessage() for r in caplog.records
        )
    finally:
        worker.inbox.close()
        worker.outbox.close()
        worker.ctx.term()


def test_launch_prints_a_failed_build(model_path, monkeypatch, capsys) -> None:
    """The command builds the kernels once before starting workers and prints the outcome;
    with a failed build it does not claim the int8 C products."""
    from splitserve import cli
    from tests.cluster_config import worker_config

    failed = KernelBuild(None, FAILED, "fake-cc: linking failed (exit 1): ld: boom")
    monkeypatch.setattr(build, "cpu_kernel_build", lambda: failed)
    config = worker_config(
        model_path,
        "colocated",
        "tcp://127.0.0.1:1",
        dtype="bfloat16",
        cpu_kernels=True,
        quantization="int8",
        device="cpu",
    )
    cli._resolve_engine(config, report=True)
    err = capsys.readouterr().err
    assert "splitserve: C kernels: BUILD FAILED (fake-cc: linking failed" in err
    assert "AVX512-VNNI C products" not in err and "the C kernels built" in err
