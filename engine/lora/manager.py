"""The LoRA adapters of one worker: those loaded (by name, their weights in host memory, in
the model's layout), the ``--max-loras`` slots the model's projections read
(:class:`~splitserve.engine.lora.slots.LoraSlots`), and each request's reference on its slot.

Reading an adapter (:meth:`LoraManager.read`: the files, their checks, the weights laid out for
the model) touches no state, so a worker runs it on a thread while it serves; registering the
result (:meth:`LoraManager.add`) is the loop's. An adapter enters a slot when a request that
needs it is admitted (``engine.sched.scheduler``); on the CPU the slot then holds the very
tensors read (no copy), on CUDA they were read onto the device.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from splitserve.engine.lora.adapters import LORA_MAX_RANK, ModelAdapters
from splitserve.engine.lora.peft import LoraError, read_adapter
from splitserve.engine.lora.slots import LoraSlots
from splitserve.engine.lora.weights import AdapterWeights, adapter_weights
from splitserve.engine.model.base import DecoderLM


@dataclass(slots=True, eq=False)
class LoadedAdapter:
    """One load of an adapter. ``key``: unique to this load (a reload under the same name is
    another adapter for the slots); ``digest``: its files' (``engine.lora.peft``)."""

    name: str
    path: str
    key: str
    weights: AdapterWeights
    pinned: bool = False
    load_s: float = 0.0  # seconds to read it

    @property
    def digest(self) -> str:
        return self.weights.digest

    @property
    def rank(self) -> int:
        return self.weights.rank


class LoraManager:
    """Loaded adapters and slots of one worker's model.

    Args:
        model: the loaded model (its projections get their adapter slots now).
        max_loras: slots: the most adapters one step can run.
        max_lora_rank: the largest rank accepted.
        max_loaded_loras: the most adapters loaded at once (0: no limit).
    """

    def __init__(self, model: DecoderLM, max_loras: int, max_lora_rank: int,
                 max_loaded_loras: int = 0) -> None:
        if not 1 <= max_lora_rank <= LORA_MAX_RANK:
            raise ValueError(f"max_lora_rank must be 1..{LORA_MAX_RANK}, not {max_lora_rank}")
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.max_loaded_loras = max_loaded_loras
        self.adapters = ModelAdapters(model, max_loras, max_lora_rank)
        self.slots = LoraSlots(max_loras, self.adapters.clear)
        self.loaded: dict[str, LoadedAdapter] = {}
        self._keys = itertools.count(1)

    # ---- loading ------------------------------------------------------------------------------

    def read(self, name: str, path: str) -> LoadedAdapter:
        """Read the adapter folder ``path`` for this model (no state changes: safe on a
        thread). Its :attr:`LoadedAdapter.load_s` is the time it took.

        Raises:
            LoraError: the folder's problem, named (``engine.lora.peft``,
                ``engine.lora.weights``).
        """
        start = time.perf_counter()
        weights = adapter_weights(read_adapter(path, self.max_lora_rank), self.model, name)
        return LoadedAdapter(name, str(path), "", weights, load_s=time.perf_counter() - start)

    def add(self, adapter: LoadedAdapter, pinned: bool = False) -> LoadedAdapter:
        """Register ``adapter`` (from :meth:`read`) under its name, replacing an earlier load
        of that name (whose slot serves the requests admitted under it, then empties); pinned:
        installed in a slot now and never evicted.

        Raises:
            LoraError: ``max_loaded_loras`` adapters are loaded already, or it cannot be
                pinned (every other slot pinned, or none free now).
        """
        old = self.loaded.get(adapter.name)
        if old is None and 0 < self.max_loaded_loras <= len(self.loaded):
            raise LoraError(f"{len(self.loaded)} adapters are loaded, the limit "
                            f"(--max-loaded-loras {self.max_loaded_loras}); unload one first")
        adapter.key = f"{adapter.name}#{next(self._keys)}"
        adapter.pinned = pinned
        if pinned and self.slots.pin(adapter.key, self._installer(adapter)) is None:
            raise LoraError(f"adapter {adapter.name!r} cannot be pinned: "
                            f"{sum(s.pinned for s in self.slots.slots)} of "
                            f"{len(self.slots.slots)} slots (--max-loras) are pinned or in "
                            "use, and one must stay free for the others")
        if old is not None:
            self.slots.retire(old.key)
        self.loaded[adapter.name] = adapter
        return adapter

    def load(self, name: str, path: str, pinned: bool = False) -> LoadedAdapter:
        """:meth:`read` then :meth:`add`, on the calling thread."""
        return self.add(self.read(name, path), pinned)

    def unload(self, name: str) -> LoadedAdapter | None:
        """Forget ``name``; its slot empties once the requests admitted under it end. Returns
        it, or None if it was not loaded."""
        adapter = self.loaded.pop(name, None)
        if adapter is not None:
            self.slots.retire(adapter.key)
        return adapter

    def get(self, name: str) -> LoadedAdapter | None:
        return self.loaded.get(name)

    # ---- slots (the scheduler's) --------------------------------------------------------------

    def acquire(self, adapter: LoadedAdapter) -> int | None:
        """A reference on ``adapter``'s slot (installed if it is not resident), or None while
        no slot can take it (:meth:`LoraSlots.acquire`). An adapter unloaded since its request
        was accepted still runs that request, in a slot that empties after it."""
        slot = self.slots.acquire(adapter.key, self._installer(adapter))
        if slot is not None and self.loaded.get(adapter.name) is not adapter:
            self.slots.retire(adapter.key)
        return slot

    def release(self, slot: int) -> None:
        self.slots.release(slot)

    def want(self, adapters: list[LoadedAdapter]) -> None:
        """The adapters waiting requests need (the scheduler's, each admission pass): those
        not resident get a slot drained for them (:meth:`LoraSlots.want`)."""
        self.slots.want({a.key for a in adapters if self.slots.find(a.key) is None})

    def _installer(self, adapter: LoadedAdapter):
        return lambda slot: self.adapters.install(slot, adapter.weights)

    # ---- what the worker reports --------------------------------------------------------------

    def resident(self) -> list[str]:
        """Names of the loaded adapters in a slot."""
        keys = set(self.slots.resident())
        return sorted(a.name for a in self.loaded.values() if a.key in keys)

    def names(self) -> list[str]:
        """Names of the loaded adapters."""
        return sorted(self.loaded)

    def digests(self) -> dict[str, str]:
        """Name -> digest of each loaded adapter's files (what its requests' prefix-cache
        namespace carries)."""
        return {name: a.digest for name, a in self.loaded.items()}
