"""Shared fixtures: the real default model (converted once into the cache), its tokenizer, and
the model loaded once per session, by the engine and by ``transformers`` (the reference)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton decides between compiler and CPU interpreter when it is first imported and when each
# kernel is decorated, and third-party packages import it early (compressed-tensors does): set
# the interpreter before any test module loads, not only in triton_device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DATA = Path(__file__).resolve().parent / "data"  # data sets, with licences: data/MANIFEST.json


@pytest.fixture(scope="session")
def model_path() -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors folder."""
    from splitserve.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def fine_tune_path(model_path: Path, tmp_path_factory) -> Path:
    """A copy of the default model folder with one tensor's values changed throughout, as a
    fine-tune changes them: the same config and shapes, other weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("fine_tune")
    for f in model_path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, path / f.name)
    tensors = load_file(model_path / "model.safetensors")
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    w += 1e-3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture
def ctx():
    """A ZeroMQ context for one test; destroyed after it, closing what the test left open
    without waiting for unsent messages (``linger=0``)."""
    import zmq

    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module's tests (``pytest.mark.usefixtures``): on a small
    shared CPU box torch's default (one thread per core) oversubscribes when other processes
    run, and every op waits for its slowest thread (10x)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model(model_path: Path):
    """``(net, config)``: the default model as the engine loads it, float32 on the CPU
    (``engine.model.loader.load_model``). Shared: a test must leave it as it found it."""
    import torch

    from splitserve.engine.model.loader import load_model

    return load_model(model_path, torch.float32)


@pytest.fixture(scope="session")
def hf_model(model_path: Path):
    """The reference: ``transformers``' model of the same folder, float32, eval mode. Shared."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def lora_adapters(model_path: Path, tmp_path_factory) -> dict[str, Path]:
    """Tiny LoRA adapters for the default model, trained with ``peft`` once per session
    (``tests.lora_adapters``): name -> PEFT folder."""
    from tests.lora_adapters import train_all

    return train_all(model_path, tmp_path_factory.mktemp("lora"))
