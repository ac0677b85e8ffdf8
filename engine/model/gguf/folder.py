"""A ``.gguf`` file as ``--model``: resolved once, at launch, into a small folder that every
process of the cluster loads like a model folder.

The folder, ``<cache>/gguf/<key>/<file stem>/`` (``key`` from the file's path, size and mtime,
so an edited file gets a new folder), holds:

- ``config.json``: the HF config from the file's metadata (``engine/model/gguf/config.py``);
- ``generation_config.json``: the stop tokens (EOS, and the end-of-turn token of a chat
  template supplied here);
- the tokenizer files, converted from the metadata by ``transformers`` (the GGUF's own chat
  template; the family's from ``engine/model/chat_templates.py`` when the file has none);
- ``model.gguf``: a symbolic link to the file. The workers read the weights from it directly,
  de-quantizing to the serving dtype (``engine/model/loader.py``); nothing is copied.

The folder's name is the served model name (the file's stem). Everything that can refuse the
file is checked before the folder is written: the file itself, its architecture and features,
and its tensor names against the model's (a bad file is one clear error at launch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from splitserve.engine.model.chat_templates import FAMILY_CHAT_FORMATS
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.gguf.config import hf_config
from splitserve.engine.model.gguf.reader import GGUFFile, open_gguf
from splitserve.engine.model.gguf.tensors import iter_tensors
from splitserve.engine.model.registry import get_architecture

logger = logging.getLogger(__name__)

WEIGHTS_LINK = "model.gguf"
_REQUIRED = ("config.json", "generation_config.json", "tokenizer_config.json", WEIGHTS_LINK)


def folder_for(path: Path, cache_dir: Path) -> Path:
    """Where :func:`resolve_gguf` puts the folder of ``path`` (which must exist)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return cache_dir / "gguf" / key[:16] / path.stem


def check_tensors(gguf: GGUFFile, config: ModelConfig) -> None:
    """Check ``gguf``'s tensor names against what the model of ``config`` takes (no data read).

    Raises:
        ValueError: tensors the model needs are absent, or tensors it has no place for.
    """
    wanted = get_architecture(config.architecture).model_class().weight_map(config)
    names = {t.hf_name: t.gguf_name for t in iter_tensors(gguf, config.num_heads,
                                                          config.num_kv_heads)}
    missing = sorted(set(wanted) - set(names))
    unused = sorted(g for h, g in names.items() if h not in wanted)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{gguf.path}: lacks tensors for {', '.join(missing[:5])}{more}")
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ValueError(
            f"{gguf.path}: tensors this architecture's model has no place for (a feature not "
            f"implemented): {', '.join(unused[:5])}{more}"
        )


def resolve_gguf(path: str | Path, cache_dir: Path) -> Path:
    """The model folder of GGUF file ``path`` (see the module docstring), made on first use.

    Concurrent callers are safe: the folder is written under a temporary name and renamed.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file cannot be served (``GGUFError`` and the checks above), naming the
            file and the cause.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    target = folder_for(path, cache_dir)
    if all((target / f).exists() for f in _REQUIRED):
        return target  # checked when it was made; the key changes with the file
    gguf = open_gguf(path)
    cfg = hf_config(gguf)
    config = ModelConfig.from_hf(cfg)
    check_tensors(gguf, config)
    logger.warning("reading the tokenizer of %s into %s (once)", path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
    try:
        _write_folder(tmp, path, gguf, cfg, config)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not all((target / f).exists() for f in _REQUIRED):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_folder(
    folder: Path, path: Path, gguf: GGUFFile, cfg: dict, config: ModelConfig
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    eos = list(config.eos_token_ids)
    for key in ("eot_token_id", "eom_token_id"):
        token = gguf.field(f"tokenizer.ggml.{key}")
        if token is not None and int(token) not in eos:
            eos.append(int(token))
    if not getattr(tokenizer, "chat_template", None):
        fmt = FAMILY_CHAT_FORMATS.get(get_architecture(config.architecture).family)
        if fmt is not None:
            logger.warning("%s has no chat template: using the family's (%s turns)",
                           path.name, fmt.end_of_turn)
            tokenizer.chat_template = fmt.template
            end = tokenizer.convert_tokens_to_ids(fmt.end_of_turn)
            if isinstance(end, int) and end != tokenizer.unk_token_id and end not in eos:
                eos.append(end)
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    os.symlink(path, folder / WEIGHTS_LINK)
