"""Model files from wheels are checked against pinned sha256 digests (``splitserve.model_digests``):
a file of the right size with other bytes is refused naming both digests, a checked file is
trusted by its stamp until it changes, and the installed default model's GGUF has the pinned
digest (hashed here, independently of the stamp)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from splitserve import default_model
from splitserve.model_digests import (
    SMOLLM2_GGUF_SHA256,
    ModelDigestError,
    sha256_of,
    verify_sha256,
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_same_size_other_bytes_is_refused(cache: Path) -> None:
    good, bad = cache / "good.gguf", cache / "bad.gguf"
    good.write_bytes(b"weights" * 1000)
    bad.write_bytes(b"weighTs" * 1000)  # same size: a size check would pass it
    want = hashlib.sha256(good.read_bytes()).hexdigest()
    verify_sha256(good, want, "good")
    with pytest.raises(ModelDigestError, match="bad: .* has sha256 [0-9a-f]{64}, expected " + want):
        verify_sha256(bad, want, "bad")


def test_stamp_trusted_until_the_file_changes(cache: Path, monkeypatch) -> None:
    f = cache / "m.gguf"
    f.write_bytes(b"abc" * 100)
    want = sha256_of(f)
    hashed = []
    real = sha256_of

    def counting(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr("splitserve.model_digests.sha256_of", counting)
    verify_sha256(f, want, "m")
    verify_sha256(f, want, "m")
    assert len(hashed) == 1  # the second check read the stamp
    f.write_bytes(b"abd" * 100)  # same size, new bytes and mtime
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(ModelDigestError):
        verify_sha256(f, want, "m")
    assert len(hashed) == 2


def test_installed_default_model_has_the_pinned_digest(cache: Path) -> None:
    path = default_model.gguf_path()  # verifies (and stamps under the temporary cache)
    assert sha256_of(path) == SMOLLM2_GGUF_SHA256
