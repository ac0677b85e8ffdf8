"""One stored KV block as bytes: a fixed header, then the payload (the page's bytes).

Header (36 bytes, little-endian): magic ``SSKV``, format version (u16), payload format (u8:
:data:`FORMATS`), a reserved byte, the block's key (16 bytes: the hash chain's digest,
``radix_cache.block_hash``), the payload length (u64) and its CRC-32 (u32, zlib's: C speed, several
GB/s). A reader checks all of it before a byte reaches the KV pool: a file renamed to another
key, truncated, or with a flipped bit is refused (:class:`BlockCorrupt`), and the tokens it
would have served are recomputed. No torch.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"SSKV"
VERSION = 1
HEADER = struct.Struct("<4sHBB16sQI")
HEADER_BYTES = HEADER.size
# The payload's format: the pool's own page bytes, or 8-bit values + float32 scales of a pool
# that stores more bits (``--kv-host-cache-dtype``; engine.kv_quant's layout).
FORMATS = ("raw", "int8", "fp8_e4m3")


class BlockCorrupt(ValueError):
    """A stored block failed its checks (magic, version, key, length or checksum)."""


def encode_header(key: str, fmt: str, payload: bytes | memoryview) -> bytes:
    """The header of ``payload`` stored under ``key`` (32 hex digits) in format ``fmt``."""
    return HEADER.pack(MAGIC, VERSION, FORMATS.index(fmt), 0, bytes.fromhex(key), len(payload),
                       zlib.crc32(payload))


def encode_block(key: str, fmt: str, payload: bytes | memoryview) -> bytes:
    """Header and payload as one bytes object."""
    return encode_header(key, fmt, payload) + bytes(payload)


def decode_block(key: str, data: bytes | memoryview, sizes: dict[str, int] | None = None
                 ) -> tuple[str, memoryview]:
    """``(fmt, payload)`` of a stored block, checked.

    Args:
        key: the key it was read under.
        data: header then payload.
        sizes: the payload length the reader expects per format (None: any; a format it does
            not list is refused).

    Raises:
        BlockCorrupt: too short, wrong magic or version, another key, truncated or too long, an
            unknown format, a length other than expected, or a checksum mismatch.
    """
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise BlockCorrupt(f"block {key}: {len(view)} bytes, shorter than its header")
    magic, version, fmt_id, _, raw_key, length, crc = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise BlockCorrupt(f"block {key}: not a splitserve KV block (magic/version)")
    if raw_key.hex() != key:
        raise BlockCorrupt(f"block {key}: header names block {raw_key.hex()}")
    if fmt_id >= len(FORMATS):
        raise BlockCorrupt(f"block {key}: unknown payload format {fmt_id}")
    payload = view[HEADER_BYTES:]
    if len(payload) != length:
        raise BlockCorrupt(f"block {key}: {len(payload)} payload bytes, header says {length}")
    if sizes is not None and sizes.get(FORMATS[fmt_id]) != length:
        raise BlockCorrupt(f"block {key}: {length} bytes of {FORMATS[fmt_id]}, expected "
                           f"{sizes.get(FORMATS[fmt_id])}")
    if zlib.crc32(payload) != crc:
        raise BlockCorrupt(f"block {key}: checksum mismatch")
    return FORMATS[fmt_id], payload
