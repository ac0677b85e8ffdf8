"""Shared fixtures: the real default model (converted once into the cache) and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"  # data sets, with licences: data/MANIFEST.json


@pytest.fixture(scope="session")
def model_path() -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors folder."""
    from splitserve.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
