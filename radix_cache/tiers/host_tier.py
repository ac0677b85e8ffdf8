"""L2: KV blocks in host memory outside the KV pool (``--kv-host-cache-mb``).

One tensor of ``num_slots`` slots, one block each, in the tier's format (the pool's bytes, or
8-bit: ``block_format``), an index from block key to slot, LRU order, and pins. Used from the
worker's engine thread only (the I/O threads never touch it). Blocks the KV pool evicts come
here (write-back) or are copied here as they are cached (write-through); blocks loaded from the
disk or the shared store land here, pinned for the request that asked, until that request is
admitted and they are copied into its pages. An unpinned block may be evicted to make room;
the caller demotes it (``tiered_cache``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from splitserve.radix_cache.tiers.block_format import BlockFormat


class HostTier:
    """Slots of host memory holding KV blocks by key.

    Args:
        num_slots: blocks it holds (>= 1).
        fmt: how a pool page is stored here (``fmt.fmt``) and read back.

    Attributes:
        buffer: ``uint8 [num_slots, fmt.block_bytes]``.
    """

    name = "l2"

    def __init__(self, num_slots: int, fmt: BlockFormat) -> None:
        if num_slots < 1:
            raise ValueError(f"an L2 tier needs at least one slot, got {num_slots}")
        self.fmt = fmt
        self.buffer = torch.empty(num_slots, fmt.block_bytes, dtype=torch.uint8)
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # every key, least recent first
        self._pins: dict[str, int] = {}

    # ---- sizes --------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.buffer.shape[0]

    @property
    def num_blocks(self) -> int:
        """Blocks held."""
        return len(self._slot)

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    @property
    def capacity_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def used_bytes(self) -> int:
        return self.num_blocks * self.buffer.shape[1]

    def room(self) -> int:
        """Blocks that could be stored now: free slots plus unpinned blocks."""
        return len(self._free) + self.num_blocks - self.num_pinned

    def keys(self) -> list[str]:
        return list(self._slot)

    # ---- lookups ------------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._slot

    def touch(self, key: str) -> None:
        """Mark ``key`` most recently used."""
        self._lru.move_to_end(key)

    def pin(self, key: str) -> None:
        """Keep ``key`` from eviction until :meth:`unpin` (counted).

        Raises:
            KeyError: ``key`` is not here.
        """
        if key not in self._slot:
            raise KeyError(key)
        self._pins[key] = self._pins.get(key, 0) + 1
        self.touch(key)

    def unpin(self, key: str) -> None:
        """Undo one :meth:`pin`.

        Raises:
            KeyError: ``key`` is not pinned.
        """
        n = self._pins[key] - 1
        if n:
            self._pins[key] = n
        else:
            del self._pins[key]

    def read(self, keys: list[str]) -> torch.Tensor:
        """The blocks of ``keys`` as pool rows, ``uint8 [len(keys), page_bytes]`` (de-quantized
        from an 8-bit tier); marks them used.

        Raises:
            KeyError: a key is not here.
        """
        slots = [self._slot[k] for k in keys]
        for k in keys:
            self.touch(k)
        payload = self.buffer[torch.tensor(slots, dtype=torch.long)]
        return self.fmt.decode(self.fmt.fmt, payload)

    def payloads(self, keys: list[str]) -> torch.Tensor:
        """Copies of the stored bytes of ``keys`` (in :attr:`fmt`), for a demotion."""
        return self.buffer[torch.tensor([self._slot[k] for k in keys], dtype=torch.long)]

    # ---- changes ------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> list[str]:
        """Free the ``num_blocks`` least recently used unpinned blocks (fewer if there are not
        that many); returns their keys. Copy what you demote (:meth:`payloads`) first."""
        victims = []
        for key in self._lru:
            if len(victims) >= num_blocks:
                break
            if key not in self._pins:
                victims.append(key)
        for key in victims:
            self._drop(key)
        return victims

    def victims(self, num_blocks: int) -> list[str]:
        """The keys :meth:`evict` would free for ``num_blocks`` more blocks, without freeing."""
        short = num_blocks - len(self._free)
        if short <= 0:
            return []
        return [k for k in self._lru if k not in self._pins][:short]

    def store(self, keys: list[str], fmt: str, payloads: torch.Tensor) -> None:
        """Hold ``payloads[i]`` (format ``fmt``: ``raw`` pool rows or a stored block's format)
        under ``keys[i]``; a key already here is only touched.

        Raises:
            MemoryError: fewer free slots than new keys (make room with :meth:`evict` first).
        """
        new = [i for i, k in enumerate(keys) if k not in self._slot]
        for k in keys:
            if k in self._slot:
                self.touch(k)
        if not new:
            return
        if len(new) > len(self._free):
            raise MemoryError(f"L2 has {len(self._free)} free slots, {len(new)} blocks to store")
        data = payloads[torch.tensor(new, dtype=torch.long)] if len(new) < len(keys) else payloads
        if fmt != self.fmt.fmt:  # a block loaded in another format: through the pool's bytes
            data = self.fmt.encode(self.fmt.decode(fmt, data))
        slots = [self._free.pop() for _ in new]
        self.buffer[torch.tensor(slots, dtype=torch.long)] = data
        for i, slot in zip(new, slots):
            self._slot[keys[i]] = slot
            self._lru[keys[i]] = None

    def clear(self) -> list[str]:
        """Drop every unpinned block; returns their keys."""
        return self.evict(self.num_blocks)

    def _drop(self, key: str) -> None:
        self._free.append(self._slot.pop(key))
        del self._lru[key]

    def check_integrity(self) -> None:
        """Every slot is free or holds exactly one key; pins name held keys.

        Raises:
            AssertionError: an inconsistency.
        """
        held = set(self._slot.values())
        assert len(held) == len(self._slot), "a slot holds two blocks"
        assert held.isdisjoint(self._free) and len(held) + len(self._free) == self.num_slots
        assert set(self._lru) == set(self._slot)
        assert set(self._pins) <= set(self._slot) and all(n > 0 for n in self._pins.values())
