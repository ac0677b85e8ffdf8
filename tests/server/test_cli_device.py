"""``--device``: its default, how it reaches the workers, and a clear refusal without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from splitserve.config import EngineConfig, ServeConfig


def test_cluster_spec_device_follows_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("SPLITSERVE_DEVICE", raising=False)
    assert ServeConfig().engine.device == "cpu"
    monkeypatch.setenv("SPLITSERVE_DEVICE", "cuda")
    assert ServeConfig().engine.device == "cuda"
    assert EngineConfig(device="cpu").device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "command",
    [["launch"], ["serve"], ["worker", "--role", "decode", "--server-addr", "tcp://127.0.0.1:9"]],
)
def test_device_cuda_without_a_gpu_is_refused_before_starting(command: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve", *command, "--device", "cuda"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--device cuda, but torch" in proc.stderr and "sees no CUDA GPU" in proc.stderr
