"""L3: KV blocks as files in a local directory (``--kv-disk-cache-dir``, ``--kv-disk-cache-gb``).

Each block is one file, ``<dir>/<identity>/<key[:2]>/<key>.kv``: the header and checksum of
``block_codec`` then the page's bytes. ``<identity>`` is the digest of the model, dtype and
layout (``block_hash.KVIdentity``), so several models may share a directory without ever reading
each other's blocks, and a worker restarted with the same model and directory finds its blocks
at once: :meth:`DiskTier.scan` indexes the files at start-up (least recently used first, by
modification time, which every read refreshes).

A write goes to a temporary file renamed into place, so a crash leaves either the whole block
or none. A full disk (``ENOSPC``) or any other write error loses that block only
(:class:`TierWriteError`, counted by the caller); a file that fails its checks when read
(truncated, flipped bits, another block's bytes) is deleted and reported as
:class:`~splitserve.radix_cache.tiers.block_codec.BlockCorrupt`, and the tokens it would have
served are recomputed. Past ``capacity_bytes`` the least recently used files are deleted.

Thread-safe: the I/O threads read and write, the engine thread asks :meth:`contains`.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from splitserve.radix_cache.tiers.block_codec import (
    HEADER_BYTES,
    BlockCorrupt,
    decode_block,
    encode_header,
)

SUFFIX = ".kv"


class TierWriteError(OSError):
    """A block could not be written (disk full, store refused or gone): it is not stored."""


class DiskTier:
    """Blocks in files under ``root / identity``, at most ``capacity_bytes`` of them.

    Args:
        root: the cache directory (created if missing).
        identity: the model/dtype/layout digest the blocks belong to (a sub-directory).
        capacity_bytes: the most bytes of block files kept (headers included).
        sizes: payload bytes per format this pool reads back (``BlockFormat.sizes``); a file of
            another size is corrupt.
    """

    name = "l3"

    def __init__(self, root: str | Path, identity: str, capacity_bytes: int,
                 sizes: dict[str, int]) -> None:
        self.dir = Path(root) / identity
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.sizes = sizes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self.used_bytes = 0
        self.scan()

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / (key + SUFFIX)

    def scan(self) -> int:
        """Index the block files already in the directory (a restart); returns how many.
        Temporary files of writes that never finished are deleted."""
        found: list[tuple[float, str, int]] = []
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(SUFFIX) and len(entry.name) == 32 + len(SUFFIX):
                    st = entry.stat()
                    found.append((st.st_mtime, entry.name[:32], st.st_size))
                elif ".tmp-" in entry.name:
                    Path(entry.path).unlink(missing_ok=True)
        found.sort()
        with self._lock:
            self._index.clear()
            self.used_bytes = 0
            for _, key, size in found:
                self._index[key] = size
                self.used_bytes += size
        return len(found)

    # ---- index --------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    # ---- I/O (the I/O threads) -----------------------------------------------------------------

    def read(self, key: str) -> tuple[str, memoryview] | None:
        """``(fmt, payload)`` of block ``key``, or None when it is not here.

        Raises:
            BlockCorrupt: the file failed its checks (it is deleted).
        """
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # least recently used order survives a restart
        except FileNotFoundError:
            self._forget(key)
            return None
        try:
            return decode_block(key, data, self.sizes)
        except BlockCorrupt:
            self.remove(key)
            raise

    def write(self, key: str, fmt: str, payload: memoryview | bytes) -> list[str]:
        """Store block ``key``; returns the keys deleted to stay under capacity (a block already
        here is only touched).

        Raises:
            TierWriteError: the disk is full or the write failed (nothing is stored).
        """
        size = HEADER_BYTES + len(payload)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
            evicted = self._make_room(size)
        for old in evicted:
            self.path(old).unlink(missing_ok=True)
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(encode_header(key, fmt, payload))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TierWriteError(exc.errno, f"L3 write of block {key} failed: {exc}") from exc
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.used_bytes += size
        return evicted

    def remove(self, key: str) -> None:
        """Delete block ``key`` if it is here."""
        self._forget(key)
        self.path(key).unlink(missing_ok=True)

    def clear(self) -> list[str]:
        """Delete every block of this identity; returns their keys."""
        keys = self.keys()
        for key in keys:
            self.remove(key)
        return keys

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size

    def _make_room(self, size: int) -> list[str]:
        """(Lock held.) Drop least recently used entries until ``size`` more bytes fit."""
        evicted = []
        while self._index and self.used_bytes + size > self.capacity_bytes:
            key, old = self._index.popitem(last=False)
            self.used_bytes -= old
            evicted.append(key)
        return evicted
