"""The scheduler's references on LoRA adapter slots (``engine.lora.slots``): a request under an
adapter is admitted only with a reference on its adapter's slot, held until its pages are freed,
so a slot in use is never overwritten (S-LoRA's and SGLang's rule). A request whose adapter gets
no slot yet waits without holding up the requests behind it, and its adapter is named to the
slots so that one drains for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.engine.lora.manager import LoraManager
from splitserve.engine.sched.request import Req


class AdapterRefs:
    """Take and give back a request's reference on its adapter's slot (``Req.lora_slot``).

    Args:
        lora: the worker's LoRA adapters (their slots), or None: no request has one.

    Raises:
        AssertionError: a request has an adapter on a worker without LoRA (``lora`` None).
    """

    __slots__ = ("lora",)

    def __init__(self, lora: LoraManager | None) -> None:
        self.lora = lora

    def acquire(self, req: Req) -> bool:
        """Whether ``req`` may be admitted as far as its adapter goes: it has none, already
        holds its slot, or got a reference on it now (``req.lora_slot`` set)."""
        if req.lora is None or req.lora_slot is not None:
            return True
        assert self.lora is not None, "a request with an adapter on a worker without LoRA"
        req.lora_slot = self.lora.acquire(req.lora)
        return req.lora_slot is not None

    def release(self, req: Req) -> None:
        """Give back ``req``'s reference, if it holds one (``req.lora_slot`` becomes None)."""
        if req.lora_slot is not None:
            assert self.lora is not None
            self.lora.release(req.lora_slot)
            req.lora_slot = None

    def want(self, pending: Iterable[Req]) -> None:
        """Name the adapters of ``pending`` (the requests not admitted yet) that hold no slot to
        the slots (each admission pass), so that a slot drains for one that has none."""
        if self.lora is not None:
            self.lora.want([r.lora for r in pending if r.lora is not None and r.lora_slot is None])
