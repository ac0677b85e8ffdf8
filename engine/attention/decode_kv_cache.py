"""A contiguous, head-major copy of the decode rows' K/V, appended to in place every step.

The pool is page-major (one page = all layers, so KV transfer moves pages as raw frames), which
makes one layer's K/V of a batch scattered over the whole pool: gathering them every layer of
every step copies the batch's entire KV once per step (at batch 32, ~200 tokens, SmolLM2: ~150 MB
per step). This cache keeps, per decoding sequence, its K (transposed) and V for every layer in
the layout :func:`~splitserve.engine.attention.decode_attention.attend` reads, or, where the C
decode kernels read it (``tiled``), with the keys in their tiles of ``KT_TILE`` positions
(``[cap / KT_TILE, D, KT_TILE]`` per slot and head: one block of keys is one contiguous run), so
a decode step only appends the new token and the attention reads the cache in place.

It is a cache of the pool, never the source of truth: the pool is still written every step, and
a sequence is copied in from the pool whenever it holds fewer tokens than the step's row needs
(new to decoding, its KV received by transfer). A sequence absent from a step's decode rows loses
its slot (back from an extend, retracted), so a slot's first ``n`` positions always equal the
pool's as long as it is kept. A slot may hold more than a row needs: a speculative verify step
runs as one decode row per drafted position sharing the sequence's slot
(``ForwardBatch.as_decode_rows``), and after it only the kept drafts' positions are valid; the
rejected ones lie past the next row's length, so no row reads them before it overwrites them, as
in the pool. Memory: ``2 * num_layers * slots * Hkv * D * cap``
elements (slots = highest live slot + headroom, cap = the longest reservation + headroom, see
below), never more than ``max_bytes`` (the backend passes the pool's own size): above that,
:meth:`plan` returns None and the caller gathers from the pool instead.

Growing means a fresh buffer, a copy, and the page faults of the fresh memory: at batch 32 and
~300 positions, ~100 ms of CPU on an idle core, several decode steps. So the cache grows when a
sequence joins, not while it decodes: it reserves each sequence's final length (prompt +
``max_new_tokens``, :func:`reserve_len`; at most twice its length, or 256 more, when that is
far off) in the step that admits it (its prompt's step, which already carries prefill work, or,
on a decode worker, the step that copies its received KV in). A step with no decode rows keeps
the buffers for the prompts it runs (:meth:`hold`) and frees them when it runs none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from splitserve.engine.attention.decode_attention import decode_bias
from splitserve.engine.kernels.cpu.bindings import KT_TILE
from splitserve.engine.kv_pool import KVPool, pages_for

# The torch products run over all ``cap`` positions (the C kernels only over each row's length):
# a slice of the position dim would make oneDNN copy K and V first (measured ~2x slower). The
# capacity grows to the reservations plus a quarter (rounded to CAP_ALIGN), so that a later
# sequence with a slightly longer prompt still fits: rare growth, at the price of up to ~25%
# unused positions (masked positions in the torch products).
CAP_ALIGN = KT_TILE  # whole tiles of the C kernels' key layout
CAP_GROWTH = 1.25
# What a sequence whose final length is far off (no max_tokens: the context) reserves at most:
# twice its length, or this many positions more.
RESERVE_AHEAD = 256


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def reserve_len(seq_len: int, max_seq_len: int | None) -> int:
    """Positions the cache reserves for a sequence of ``seq_len`` tokens that can reach
    ``max_seq_len`` (None: unknown, nothing ahead): all of them, up to twice ``seq_len`` or
    ``RESERVE_AHEAD`` more, whichever is larger."""
    if max_seq_len is None:
        return seq_len
    return max(seq_len, min(max_seq_len, seq_len + max(seq_len, RESERVE_AHEAD)))


class StepTargets(NamedTuple):
    """Where a decode-only step's rows live in the cache, for a caller that appends every
    layer's K/V and reads them itself (the fused decode layers, ``engine.model.fused_decode``).

    Over an 8-bit pool read in place there is no cache: ``kt``, ``v``, ``slots`` and
    ``positions`` are None and ``pages`` says where each row's K/V are.

    Attributes:
        kt: ``[L, slots, Hkv, cap / KT_TILE, D, KT_TILE]`` keys in the C kernels' tiles; v:
            ``[L, slots, Hkv, cap, D]``.
        slots: ``[M]`` int64 slot of each row; positions: ``[M]`` int64 its new token's
            position; lens: ``[M]`` int64 its KV length after the step.
        pages: ``[M, P]`` int64 page ids of each row's sequence (pool read in place), or None.
    """

    kt: torch.Tensor | None
    v: torch.Tensor | None
    slots: torch.Tensor | None
    positions: torch.Tensor | None
    lens: torch.Tensor
    pages: torch.Tensor | None = None


@dataclass(slots=True)
class DecodePlan:
    """Where one step's decode rows live in the cache.

    The C kernels read only ``slots``, ``lens`` and ``positions``; the torch path's mask and
    append indices (``biases``, ``kt_index``, ``v_index``) are built on first use, so a step the
    C kernels serve never pays for them (~0.3 ms a step on one core).

    Attributes:
        slots: ``[Bd]`` int64 slot of each decode row, in batch order.
        num_slots: slots the products run over (``max(slots) + 1``; free slots in between
            compute discarded rows).
        is_identity: ``slots == arange(Bd)`` and ``num_slots == Bd``: no scatter/gather of q/out.
        shares_slots: some rows share a slot (a sequence's drafted positions); ``slot_lens``
            then has the slot's last row's length, and q cannot be scattered to slots.
        num_keys: key positions the products read: the cache's whole capacity, so that each
            layer's ``kt``/``v`` of the first ``num_slots`` slots is one contiguous block.
        lens: ``[Bd]`` int64 KV length of each row after the step (for the C kernels, which
            read and write each row's slot directly and need no mask).
        positions: ``[Bd]`` int64 position of each row's new token (``lens - 1``).
        windows: the sliding windows the step's layers use (None: no window), one mask each.
        slot_lens: tokens cached per slot ``0 .. num_slots - 1`` after the step (0: free).
        num_kv_heads, head_dim, dtype, tiled: the cache's.
    """

    slots: torch.Tensor
    num_slots: int
    is_identity: bool
    shares_slots: bool
    num_keys: int
    lens: torch.Tensor
    positions: torch.Tensor
    windows: tuple[int | None, ...]
    slot_lens: list[int]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    tiled: bool = False
    _biases: dict[int | None, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _kt_index: torch.Tensor | None = field(default=None, init=False, repr=False)
    _v_index: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def biases(self) -> dict[int | None, torch.Tensor]:
        """Per window in :attr:`windows`, the ``[num_slots * Hkv, 1, num_keys]`` additive mask
        (see ``decode_bias``)."""
        if self._biases is None:
            dev, hkv = self.slots.device, self.num_kv_heads
            self._biases = {
                w: decode_bias(self.slot_lens, self.num_keys, hkv, w, self.dtype, dev)
                for w in self.windows
            }
        return self._biases

    @property
    def kt_index(self) -> torch.Tensor:
        """``[Bd * Hkv * D]`` int64 flat indices of the new tokens' keys in one layer's ``kt``
        (flattened, tiled or not), in ``k [Bd, Hkv, D]`` order."""
        if self._kt_index is None:
            self._index()
        assert self._kt_index is not None
        return self._kt_index

    @property
    def v_index(self) -> torch.Tensor:
        """``[Bd * Hkv]`` int64 row indices of the new tokens' values in one layer's ``v``
        viewed as ``[-1, D]``."""
        if self._v_index is None:
            self._index()
        assert self._v_index is not None
        return self._v_index

    def _index(self) -> None:
        dev, hkv, d, cap = self.slots.device, self.num_kv_heads, self.head_dim, self.num_keys
        pos = self.positions
        head = self.slots[:, None] * hkv + torch.arange(hkv, device=dev)[None, :]  # [Bd, Hkv]
        dims = torch.arange(d, device=dev)
        if self.tiled:  # kernels.h kt_offset: tile, then dimension, then position in the tile
            at = (pos // KT_TILE) * d * KT_TILE + pos % KT_TILE
            kt_index = head[:, :, None] * d * cap + dims * KT_TILE + at[:, None, None]
        else:
            kt_index = (head[:, :, None] * d + dims) * cap + pos[:, None, None]
        self._kt_index = kt_index.flatten()
        self._v_index = (head * cap + pos[:, None]).flatten()


class DecodeKVCache:
    """Per-worker decode K/V copy for one pool; see the module docstring.

    Args:
        pool: the KV pool it mirrors (its read-back dtype ``pool.dtype`` is the cache's: an
            8-bit pool's pages are de-quantized as they are copied in, and each new token is
            stored as the pool reads it back, so the cache and a gather see the same values).
        max_bytes: upper bound on the cache's memory.
        tiled: keep the keys in the C decode kernels' layout (``[.., cap / KT_TILE, D,
            KT_TILE]`` per layer, ``CpuKernels.decode_attention``) rather than the torch
            products' ``[.., D, cap]``; the torch path (:meth:`views`) then cannot read it.
    """

    def __init__(self, pool: KVPool, max_bytes: int, tiled: bool = False) -> None:
        self.pool = pool
        self.max_bytes = max_bytes
        self.tiled = tiled
        layout = pool.layout
        self.num_layers, self.hkv, self.d = layout.num_layers, layout.num_kv_heads, layout.head_dim
        self.dtype, self.device = pool.dtype, pool.buffer.device
        # [L, slots, Hkv, D, cap], or tiled [L, slots, Hkv, cap / KT_TILE, D, KT_TILE]
        self.kt: torch.Tensor | None = None
        self.v: torch.Tensor | None = None  # [L, slots, Hkv, cap, D]
        self.slot_of: dict[int, int] = {}  # sequence id -> slot
        self.len_of: list[int] = []  # tokens cached per slot (0: free)
        self._layers_left = 0  # appends still due for the planned step

    @property
    def nbytes(self) -> int:
        """Memory held now."""
        return sum(t.numel() * t.element_size() for t in (self.kt, self.v) if t is not None)

    def clear(self) -> None:
        """Drop every sequence and free the memory."""
        self.kt = self.v = None
        self._drop_all()

    def plan(
        self,
        seq_ids: list[int],
        lens: list[int],
        pages: torch.Tensor,
        window: int | None | Iterable[int | None],
        max_lens: Sequence[int | None] | None = None,
        joining: Sequence[tuple[int, int]] = (),
    ) -> DecodePlan | None:
        """Assign slots for one step's decode rows, copy stale rows in from the pool (all layers
        at once) and build the step's indices and mask. Call before the step's first layer.

        Args:
            seq_ids: ``Bd`` sequence ids, stable while a sequence lives; unique, but for
                consecutive rows of one sequence with lengths one apart (its drafted
                positions), which share its slot.
            lens: ``Bd`` KV lengths after the step (the new token sits at ``lens[i] - 1``).
            pages: ``[Bd, P]`` int64 page ids of each row (``P`` pages cover the longest row).
            window: sliding window, or None; or every distinct window of the step's layers
                (a mask is built for each).
            max_lens: ``Bd`` most KV each row can reach (None: unknown); a row new to the
                cache gets its :func:`reserve_len`, so it need not grow while it decodes.
            joining: ``(length after the step, most KV it can reach)`` of each sequence that
                decodes from a later step (this step's prompt rows): slots and capacity are
                reserved for them now, in the step that admits them.

        Returns:
            The plan, or None when the cache would exceed ``max_bytes`` or ``seq_ids`` repeat
            otherwise (the cache is then empty and the caller gathers from the pool).
        """
        if self._layers_left:  # the last planned step did not finish: its appends are partial
            self.clear()
        if not _runs_of_one_sequence(seq_ids, lens):
            self.clear()
            return None
        live = dict.fromkeys(seq_ids)
        for sid in [s for s in self.slot_of if s not in live]:
            self.len_of[self.slot_of.pop(sid)] = 0
        bounds = [None] * len(lens) if max_lens is None else max_lens
        slots, stale = [], []
        wanted = reserved = 0  # reservations: of rows new to the cache, of every row
        for i, (sid, n, bound) in enumerate(zip(seq_ids, lens, bounds, strict=True)):
            reserve = self._reserve(n, bound)
            reserved = max(reserved, reserve)
            if i and sid == seq_ids[i - 1]:  # the next drafted position: same slot, one on
                self.len_of[slots[-1]] = n
                slots.append(slots[-1])
                continue
            slot = self.slot_of.get(sid)
            if slot is None:
                slot = self._free_slot()
                self.slot_of[sid] = slot
                wanted = max(wanted, reserve)
            # A kept slot's first len_of positions equal the pool's (module docstring): enough
            # when they cover the row's prefix; past it, rejected drafts' stale K/V, which this
            # step's rows overwrite before any row reads them.
            if self.len_of[slot] < n - 1:
                stale.append(i)
            self.len_of[slot] = n
            slots.append(slot)
        for n, bound in joining:
            wanted = max(wanted, self._reserve(n, bound))
        reserved = max(reserved, wanted)
        num_slots = max(slots) + 1
        num_keys = max(pages.shape[1] * self.pool.page_size, max(lens))
        if not self._fit(num_slots, num_keys, self._slots_with(len(joining)), wanted, reserved):
            self.clear()
            return None
        for i in stale:
            self._fill(slots[i], lens[i] - 1, pages[i])
        self._layers_left = self.num_layers
        windows = [window] if window is None or isinstance(window, int) else list(window)
        return self._build_plan(slots, list(lens), num_slots, windows)

    def hold(self, joining: Sequence[tuple[int, int]]) -> None:
        """A step with no decode rows: every sequence loses its slot, and the buffers are kept
        (or made) for ``joining`` (``(length after the step, most KV it can reach)`` of the
        step's prompt rows that will decode), in the step that admits them. They are freed
        when there are none, and reallocated (nothing to copy) when they are too small for the
        reservations or would use under a quarter of them."""
        if not joining:
            self.clear()
            return
        self._drop_all()
        want_slots = len(joining)
        want_keys = max(self._reserve(n, bound) for n, bound in joining)
        size = self._bytes(_round_up(want_slots, 8), _round_up(want_keys, CAP_ALIGN))
        slots, cap = self._held()
        resize = want_slots > slots or want_keys > cap or 4 * size < self.nbytes
        if resize and not self._fit(0, 0, want_slots, want_keys, want_keys, keep=False):
            self.clear()

    def append(self, layer: int, plan: DecodePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' ``k``/``v [Bd, Hkv, D]`` of ``layer``."""
        assert self.kt is not None and self.v is not None
        if self.pool.layout.is_quantized:
            k, v = self.pool.round_trip(k), self.pool.round_trip(v)
        k, v = k.to(self.dtype), v.to(self.dtype)
        self.kt[layer].view(-1).index_copy_(0, plan.kt_index, k.reshape(-1))
        self.v[layer].view(-1, self.d).index_copy_(0, plan.v_index, v.reshape(-1, self.d))
        self._layers_left -= 1

    def append_targets(
        self, layer: int, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the C ``kv_append`` kernel writes ``layer``'s new tokens into, in place of
        :meth:`append`: ``(kt [slots, Hkv, cap / KT_TILE, D, KT_TILE], v [slots, Hkv, cap,
        D], slots [Bd], positions [Bd])`` (a tiled cache). Counts as the layer's append."""
        assert self.kt is not None and self.v is not None
        self._layers_left -= 1
        return self.kt[layer], self.v[layer], plan.slots, plan.positions

    def append_all_targets(self, plan: DecodePlan) -> StepTargets:
        """:meth:`append_targets` for every layer at once (the fused decode layers write
        them all), with the rows' lengths. Counts as every layer's append."""
        assert self.kt is not None and self.v is not None
        self._layers_left = 0
        return StepTargets(self.kt, self.v, plan.slots, plan.positions, plan.lens)

    def slot_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``kt`` and ``v [slots, Hkv, cap, D]`` of ``layer``, every slot (contiguous views; the
        C decode kernel indexes them by ``plan.slots``): ``kt [slots, Hkv, D, cap]``, or tiled
        ``[slots, Hkv, cap / KT_TILE, D, KT_TILE]``."""
        assert self.kt is not None and self.v is not None
        return self.kt[layer], self.v[layer]

    def views(self, layer: int, plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``kt [num_slots * Hkv, D, num_keys]`` and ``v [num_slots * Hkv, num_keys, D]`` of
        ``layer``: contiguous views of the cache, no copy. Not for a tiled cache."""
        assert self.kt is not None and self.v is not None and not self.tiled
        n, s = plan.num_slots, plan.num_keys
        kt = self.kt[layer, :n].view(n * self.hkv, self.d, s)
        return kt, self.v[layer, :n].view(n * self.hkv, s, self.d)

    # ---- internals ----------------------------------------------------------------------------

    def _held(self) -> tuple[int, int]:
        """``(slots, cap)`` of the buffers held, ``(0, 0)`` for none."""
        return (0, 0) if self.v is None else (self.v.shape[1], self.v.shape[3])

    def _drop_all(self) -> None:
        """Drop every sequence, keeping the memory."""
        self.slot_of, self.len_of = {}, []
        self._layers_left = 0

    def _free_slot(self) -> int:
        # A taken slot has a length >= 1 from the moment it is assigned.
        for slot, n in enumerate(self.len_of):
            if n == 0:
                return slot
        self.len_of.append(0)
        return len(self.len_of) - 1

    def _reserve(self, seq_len: int, max_seq_len: int | None) -> int:
        # Whole pages: a sequence is copied in from the pool a page at a time.
        return _round_up(reserve_len(seq_len, max_seq_len), self.pool.page_size)

    def _slots_with(self, num_joining: int) -> int:
        """Slots needed once ``num_joining`` more sequences take the lowest free ones."""
        free = [s for s, n in enumerate(self.len_of) if n == 0]
        if num_joining <= len(free):
            return free[num_joining - 1] + 1 if num_joining else 0
        return len(self.len_of) + num_joining - len(free)

    def _bytes(self, slots: int, cap: int) -> int:
        return 2 * self.num_layers * slots * self.hkv * self.d * cap * self.dtype.itemsize

    def _fit(
        self,
        num_slots: int,
        num_keys: int,
        want_slots: int,
        want_keys: int,
        reserved: int,
        keep: bool = True,
    ) -> bool:
        """Make the buffers hold ``num_slots`` slots of ``num_keys`` positions (this step's
        need) and ``want_slots`` slots of ``want_keys`` (the reservations of sequences new to
        the cache), within ``max_bytes``: a growth (the only allocation) sizes the capacity to
        ``reserved`` (every live sequence's reservation) plus headroom, and is clipped to what
        fits. ``keep``: copy the cached sequences over (False: none are cached; the buffers
        are sized afresh, and kept if that is their size). Returns False if the need cannot
        fit."""
        held = self._held()
        old_slots, old_cap = held if keep else (0, 0)
        need_slots, need_keys = max(num_slots, want_slots), max(num_keys, want_keys)
        if need_slots <= old_slots and need_keys <= old_cap:
            return True
        slots = old_slots
        if need_slots > old_slots:
            slots = _round_up(max(need_slots, old_slots * 3 // 2), 8)
        cap = old_cap
        if need_keys > old_cap:
            cap = _round_up(int(max(need_keys, reserved, old_cap) * CAP_GROWTH), CAP_ALIGN)
        if self._bytes(slots, cap) > self.max_bytes:  # no slot headroom; the capacity that fits
            slots = max(num_slots or want_slots, old_slots)
            fits = self.max_bytes // self._bytes(slots, 1) // CAP_ALIGN * CAP_ALIGN
            cap = max(min(cap, fits), _round_up(num_keys, CAP_ALIGN), old_cap)
            if self._bytes(slots, cap) > self.max_bytes:
                return False
        if cap == 0 or (slots, cap) == held:  # only reservations that do not fit missed
            return True
        shape = (self.num_layers, slots, self.hkv)
        # Zeros, not empty: masked positions still enter the products (as -inf scores and
        # probability-0 values), so they must hold finite numbers.
        kt_shape = (cap // KT_TILE, self.d, KT_TILE) if self.tiled else (self.d, cap)
        kt = torch.zeros(*shape, *kt_shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(*shape, cap, self.d, dtype=self.dtype, device=self.device)
        if keep and self.kt is not None and self.v is not None:
            if self.tiled:  # whole tiles: old_cap is a multiple of CAP_ALIGN = KT_TILE
                kt[:, :old_slots, :, : old_cap // KT_TILE] = self.kt
            else:
                kt[:, :old_slots, :, :, :old_cap] = self.kt
            v[:, :old_slots, :, :old_cap] = self.v
        self.kt, self.v = kt, v
        return True

    def _fill(self, slot: int, num_tokens: int, pages: torch.Tensor) -> None:
        """Copy a sequence's first ``num_tokens`` tokens, every layer, from the pool."""
        if num_tokens == 0:
            return
        assert self.kt is not None and self.v is not None
        ps = self.pool.page_size
        np_ = pages_for(num_tokens, ps)
        # [np, L, 2, ps, Hkv, D]: whole pages (all layers) are contiguous rows of the pool.
        g = self.pool.gather_pages(pages[:np_], self.dtype)
        n = np_ * ps  # whole pages; positions past num_tokens are masked until written
        if self.tiled:  # [L, n, Hkv, D] by position; the whole tiles, then a partial last one
            keys = g[:, :, 0].permute(1, 0, 2, 3, 4).reshape(self.num_layers, n, self.hkv, self.d)
            full, rest = divmod(n, KT_TILE)
            tiles = self.kt[:, slot]  # [L, Hkv, cap / KT_TILE, D, KT_TILE]
            shape = (self.num_layers, full, KT_TILE, self.hkv, self.d)
            tiles[:, :, :full].copy_(keys[:, : full * KT_TILE].view(shape).permute(0, 3, 1, 4, 2))
            if rest:
                tiles[:, :, full, :, :rest].copy_(keys[:, full * KT_TILE :].permute(0, 2, 3, 1))
        else:
            self.kt[:, slot, :, :, :n].view(self.num_layers, self.hkv, self.d, np_, ps).copy_(
                g[:, :, 0].permute(1, 3, 4, 0, 2)
            )
        self.v[:, slot, :, :n].view(self.num_layers, self.hkv, np_, ps, self.d).copy_(
            g[:, :, 1].permute(1, 3, 0, 2, 4)
        )

    def _build_plan(
        self, slots: list[int], lens: list[int], num_slots: int, windows: list[int | None]
    ) -> DecodePlan:
        assert self.kt is not None
        # One tensor for the three per-row vectors: each row of it is contiguous.
        rows = torch.tensor(
            [slots, lens, [n - 1 for n in lens]], dtype=torch.long, device=self.device
        )
        return DecodePlan(
            slots=rows[0],
            num_slots=num_slots,
            is_identity=num_slots == len(slots) and slots == list(range(num_slots)),
            shares_slots=len(set(slots)) != len(slots),
            num_keys=self._held()[1],
            lens=rows[1],
            positions=rows[2],
            windows=tuple(dict.fromkeys(windows)),
            slot_lens=self.len_of[:num_slots],
            num_kv_heads=self.hkv,
            head_dim=self.d,
            dtype=self.dtype,
            tiled=self.tiled,
        )


def _runs_of_one_sequence(seq_ids: Sequence[int], lens: Sequence[int]) -> bool:
    """Whether each repeated id only repeats in consecutive rows with lengths one apart (one
    sequence's drafted positions, ``ForwardBatch.as_decode_rows``)."""
    seen: set[int] = set()
    for i, sid in enumerate(seq_ids):
        if i and sid == seq_ids[i - 1]:
            if lens[i] != lens[i - 1] + 1:
                return False
        elif sid in seen:
            return False
        seen.add(sid)
    return True
