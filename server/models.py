"""The models a request may name: the base model and the LoRA adapters served on it.

A request's ``model`` resolves here, in one place every job goes through
(``server.job_builder``): the base model's served name (or ``default``) runs the base weights;
an adapter's name runs it (a :class:`~splitserve.ipc.messages.LoraRef` on the job and its
tasks); any other name is a 404 naming it (``model_not_found``, as OpenAI and vLLM answer).
``GET /v1/models`` lists the base and every adapter, each adapter with ``parent`` = the base
(vLLM's form). Adapters come from ``--lora-modules`` at start and from
``POST /v1/load_lora_adapter`` at run time (``server.lora_routes``); a run-time path must lie
under ``--lora-dir`` when it is set. No torch, no engine: the workers read and check the
adapter files, and their verdict is the load's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.ipc.messages import LoraRef
from splitserve.server.errors import APIError

MODEL_ALIAS = "default"  # accepted as ``model`` whatever the served model is called


@dataclass(slots=True)
class ServedAdapter:
    """An adapter served now: its folder (absolute), when it was added, whether it is pinned,
    and what the workers read there (its files' digest, its rank)."""

    name: str
    path: str
    created: int
    pinned: bool = False
    digest: str = ""
    rank: int = 0

    @property
    def ref(self) -> LoraRef:
        return LoraRef(self.name, self.path)


class ServedModels:
    """The base model's names and the adapters served on it.

    Args:
        base: the base model's served name (its folder's name).
        lora_enabled: adapters may be loaded at run time (``EngineConfig.lora_enabled``).
        lora_dir: run-time adapter folders must lie under it (None: anywhere).
        adapters: the adapters served from the start (``--lora-modules``: name -> folder;
            ``pinned``: those of ``--pinned-loras``).
    """

    def __init__(self, base: str, lora_enabled: bool = False, lora_dir: str | None = None,
                 adapters: dict[str, str] | None = None, pinned: list[str] | tuple = ()) -> None:
        self.base = base
        self.lora_enabled = lora_enabled or bool(adapters) or lora_dir is not None
        self.lora_dir = None if lora_dir is None else Path(lora_dir).resolve()
        now = int(time.time())
        self.adapters: dict[str, ServedAdapter] = {
            name: ServedAdapter(name, str(Path(path).absolute()), now, name in pinned)
            for name, path in (adapters or {}).items()
        }

    def is_base(self, model: str) -> bool:
        """Whether ``model`` names the base model."""
        return model in (self.base, MODEL_ALIAS)

    def serves(self, model: str) -> bool:
        """Whether ``model`` names the base model or a served adapter."""
        return self.is_base(model) or model in self.adapters

    def resolve(self, model: str) -> LoraRef | None:
        """The adapter ``model`` names, or None for the base model.

        Raises:
            APIError: 404 ``model_not_found`` naming ``model`` (and what is served instead).
        """
        if self.is_base(model):
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise self.not_found(model)
        return adapter.ref

    def not_found(self, model: str) -> APIError:
        """The 404 for a ``model`` this server does not serve."""
        names = ", ".join(repr(n) for n in [self.base, *sorted(self.adapters)])
        return APIError(f"model '{model}' does not exist; this server serves {names}",
                        param="model", status_code=404, type="invalid_request_error",
                        code="model_not_found")

    def runtime_path(self, path: str) -> str:
        """The absolute folder a run-time load of ``path`` reads (a relative path is taken
        under ``--lora-dir`` when it is set).

        Raises:
            APIError: 400 naming ``lora_path`` when it lies outside ``--lora-dir`` (symbolic
                links resolved first), or 400 when adapters are not enabled.
        """
        if not self.lora_enabled:
            raise APIError("LoRA adapters are not enabled on this server: start it with "
                           "--enable-lora (or --lora-modules)", param="lora_path")
        p = Path(path)
        if self.lora_dir is not None:
            p = (self.lora_dir / p).resolve() if not p.is_absolute() else p.resolve()
            if not p.is_relative_to(self.lora_dir):
                raise APIError(f"lora_path: {path} is outside the folder adapters may be loaded "
                               f"from (--lora-dir {self.lora_dir})", param="lora_path")
            return str(p)
        return str(p.absolute())

    def cards(self, created: int, context_len: int) -> list[dict[str, Any]]:
        """``GET /v1/models``' entries: the base, then each adapter with its ``parent``."""
        base = {"id": self.base, "object": "model", "created": created, "owned_by": "splitserve",
                "max_model_len": context_len, "root": self.base, "parent": None}
        return [base] + [self.card(a.name, created, context_len)
                         for a in sorted(self.adapters.values(), key=lambda a: a.name)]

    def card(self, model: str, created: int, context_len: int) -> dict[str, Any]:
        """The entry of ``model`` (base or adapter).

        Raises:
            APIError: 404 for a name not served.
        """
        if self.is_base(model):
            return self.cards(created, context_len)[0]
        a = self.adapters.get(model)
        if a is None:
            raise self.not_found(model)
        return {"id": a.name, "object": "model", "created": a.created, "owned_by": "splitserve",
                "max_model_len": context_len, "root": a.path, "parent": self.base}
