"""The pluggable parts by name: one table that feeds both the CLI's choices and the factories.

Each entry names its implementation as ``"module:attribute"`` and is imported only when chosen,
so ``splitserve --help`` (and a process that never uses an optional backend) imports neither
torch nor NIXL. The factories that build a part live with the part and call :meth:`Registry.load`:

================  ==================================================  =========================
part              factory                                             CLI flag
================  ==================================================  =========================
attention         ``engine.attention.base.create_attention_backend``  ``--attention``
prefix cache      ``radix_cache.create_prefix_cache``                 ``--prefix-cache``
routing           ``server.routing.create_routing_policy``            ``--routing``
grammar backend   ``engine.grammar.registry.create_backend``          ``--grammar-backend``
KV transfer       ``kv_transfer.registry``                            ``--kv-transfer``
tool-call parser  ``server.chat_template.ChatRenderer``               ``--tool-call-parser``
reasoning parser  ``server.chat_template.ChatRenderer``               ``--reasoning-parser``
worker role       ``worker.main.create_worker``                       ``--role``
================  ==================================================  =========================

Adding an implementation is one line here and its module; nothing else needs to know it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Registry:
    """Names of one part's implementations -> ``"module:attribute"``; the first is the default."""

    part: str
    entries: Mapping[str, str]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    @property
    def default(self) -> str:
        return next(iter(self.entries))

    def check(self, name: str) -> str:
        """Return ``name`` if registered.

        Raises:
            ValueError: naming the part and the registered names.
        """
        if name not in self.entries:
            raise ValueError(f"unknown {self.part} {name!r}: expected one of {self.names}")
        return name

    def load(self, name: str) -> Any:
        """Import and return the implementation registered as ``name``.

        Raises:
            ValueError: an unknown name.
            ImportError: the implementation's module (or an optional package it needs) is
                missing.
        """
        module, _, attr = self.entries[self.check(name)].partition(":")
        return getattr(importlib.import_module(module), attr)


ATTENTION = Registry("attention backend", {
    "torch": "splitserve.engine.attention.torch_backend:TorchAttentionBackend",
    "triton": "splitserve.engine.attention.triton.backend:TritonAttentionBackend",
})
PREFIX_CACHE = Registry("prefix cache", {
    "radix": "splitserve.radix_cache.prefix_cache:RadixPrefixCache",
    "none": "splitserve.engine.sched.prefix_cache:NoPrefixCache",
})
ROUTING = Registry("routing policy", {
    "cache_aware": "splitserve.server.routing:CacheAwarePolicy",
    "round_robin": "splitserve.server.routing:RoundRobinPolicy",
})
# The order is the chain's default order (constraints/chain.py): soundness first, then compile
# and mask time, as measured by tests/grammar/test_grammar_conformance.py and bench/grammar.py.
GRAMMAR_BACKEND = Registry("grammar backend", {
    "llguidance": "splitserve.engine.grammar.llguidance_backend:LLGuidanceBackend",
    "xgrammar": "splitserve.engine.grammar.xgrammar_backend:XGrammarBackend",
    "outlines": "splitserve.engine.grammar.outlines_backend:OutlinesBackend",
})
KV_TRANSFER = Registry("KV transfer backend", {
    "zmq": "splitserve.kv_transfer.zmq_backend:BACKEND",
    "shm": "splitserve.kv_transfer.shm_backend:BACKEND",
    "mooncake": "splitserve.kv_transfer.mooncake_backend:BACKEND",
    "nixl": "splitserve.kv_transfer.nixl_backend:BACKEND",
})
TOOL_CALL_PARSER = Registry("tool-call parser", {
    "hermes": "splitserve.server.tools.formats:HERMES",
    "llama3_json": "splitserve.server.tools.formats:LLAMA3_JSON",
    "mistral": "splitserve.server.tools.formats:MISTRAL",
    "qwen3_coder": "splitserve.server.tools.formats:QWEN3_CODER",
    "pythonic": "splitserve.server.tools.formats:PYTHONIC",
    "deepseek_v3": "splitserve.server.tools.formats:DEEPSEEK_V3",
})
REASONING_PARSER = Registry("reasoning parser", {
    "qwen3": "splitserve.server.reasoning.formats:QWEN3",
    "deepseek_r1": "splitserve.server.reasoning.formats:DEEPSEEK_R1",
})
WORKER_ROLE = Registry("worker role", {
    "prefill": "splitserve.prefill.policy:PREFILL",
    "decode": "splitserve.decode.policy:DECODE",
    "colocated": "splitserve.worker.colocated:COLOCATED",
})
