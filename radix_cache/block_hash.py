"""Content addresses of KV blocks: a hash chain over what decides a page's K/V bytes.

A block is one KV page: ``page_size`` tokens, all layers' K and V. Its key is

    root      = H("splitserve-kv-1", identity digest, namespace, adapter)
    key[0]    = H(root,     tokens[0 : page_size])
    key[i]    = H(key[i-1], tokens[i * page_size : (i + 1) * page_size])

where the identity digest (:class:`KVIdentity`) covers the model's weights (architecture,
parsed-config fingerprint, ``--quantization`` and the digest of the loaded values,
``engine.model.weight_digest``), the dtype K/V are computed in, the pool layout (layers, KV heads,
head size, ``--kv-cache-dtype``) and the page size. So a key names the exact bytes of a page:
the same tokens after the same prefix, under the same weights, layout and tenant. Two models,
two layouts, two tenants (``namespace``: the API key's tenant and ``cache_salt``, hashed by the
server) or two LoRA adapters never share a key, in any tier, across restarts, across hosts.
This is the chained block hash of vLLM's prefix caching and Dynamo's KV router, with the model's
identity in the root instead of beside the table.

``adapter`` is the LoRA adapter a request runs with ("" for the base model): multi-LoRA passes
the adapter's id, and its blocks are addressed apart from the base model's.

H is BLAKE2b with a 16-byte digest (hashlib; ~1 us per page). Keys are 32 hex digits. Tokens are
hashed as little-endian int32. No torch: the router computes the same keys to read KV events.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

SCHEME = b"splitserve-kv-1"
DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """What besides the tokens decides a page's K/V bytes.

    Attributes:
        weights: the weights' identity: ``architecture/config fingerprint/quantization/weights
            digest`` (``ipc.messages.WeightsMsg`` joined).
        dtype: the dtype K/V are computed in (``float32``, ``bfloat16``...).
        layout: ``layers x kv_heads x head_dim / kv_cache_dtype`` of the pool.
        page_size: tokens per block.
    """

    weights: str
    dtype: str
    layout: str
    page_size: int

    def digest(self) -> str:
        """32 hex digits naming this identity (the chain's root covers it)."""
        text = f"{self.weights}|{self.dtype}|{self.layout}|{self.page_size}".encode()
        return hashlib.blake2b(text, digest_size=DIGEST_BYTES).hexdigest()


def chain_root(identity_digest: str, namespace: str | None, adapter: str = "") -> bytes:
    """The chain's seed for one identity, prefix-cache namespace (None: the shared one) and
    LoRA ``adapter`` ("" for the base model)."""
    h = hashlib.blake2b(SCHEME, digest_size=DIGEST_BYTES)
    for part in (identity_digest, "\x00" if namespace is None else f"ns:{namespace}", adapter):
        data = part.encode()
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.digest()


def block_keys(root: bytes, tokens: Sequence[int], page_size: int) -> list[str]:
    """Keys of the whole pages of ``tokens`` (a partial last page has none), in order.

    Raises:
        ValueError: ``page_size < 1``.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    n = len(tokens) // page_size
    keys: list[str] = []
    prev = root
    fmt = f"<{page_size}i"
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES)
        h.update(struct.pack(fmt, *tokens[i * page_size : (i + 1) * page_size]))
        prev = h.digest()
        keys.append(prev.hex())
    return keys
