"""The architecture table: Hugging Face ``architectures`` name -> the model family that serves it.

A model folder's ``config.json`` names its class in ``architectures`` (``Qwen3ForCausalLM``); a
GGUF file names its family in ``general.architecture`` (``qwen3``). Both are looked up here, and
nothing else in the engine lists architectures: adding one is a row here, a model file, and (for
GGUF) its metadata keys in ``engine/model/gguf/config.py``.

==========================  ===========  ==============  =====================================
HF ``architectures``        family       GGUF name       model class
==========================  ===========  ==============  =====================================
LlamaForCausalLM            llama        llama           ``llama:LlamaForCausalLM``
MistralForCausalLM          llama        (as llama)      ``llama:LlamaForCausalLM``
Qwen2ForCausalLM            llama        qwen2           ``llama:LlamaForCausalLM``
Qwen3ForCausalLM            qwen3        qwen3           ``qwen3:Qwen3ForCausalLM``
Qwen3MoeForCausalLM         qwen3_moe    qwen3moe        ``qwen3_moe:Qwen3MoeForCausalLM``
Gemma3ForCausalLM           gemma3       gemma3          ``gemma3:Gemma3ForCausalLM``
Phi3ForCausalLM             phi3         phi3            ``phi3:Phi3ForCausalLM``
==========================  ===========  ==============  =====================================

``tool_call_format`` names how the family's own chat template asks the model to write a tool
call, for the server's tool-call parser: ``hermes`` (``<tool_call>{"name": ..., "arguments":
...}</tool_call>``, Qwen 2.5/3), ``llama3_json`` (a bare JSON object, Llama 3.1+), ``mistral``
(``[TOOL_CALLS] [...]``); None where the template has no tool-call format (Gemma 3, Phi-3).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

_MODELS = "splitserve.engine.model"


@dataclass(frozen=True, slots=True)
class Architecture:
    """One supported Hugging Face architecture.

    Attributes:
        name: the ``architectures`` entry of ``config.json``.
        family: the model file that implements it (``engine/model/<family>.py``, with Mistral
            and Qwen2 in ``llama.py``).
        model: ``"module:attribute"`` of the model class.
        gguf_name: ``general.architecture`` of a GGUF file of this architecture, or None.
        tool_call_format: see the module docstring.
    """

    name: str
    family: str
    model: str
    gguf_name: str | None
    tool_call_format: str | None

    def model_class(self) -> Any:
        """Import and return the model class."""
        module, _, attr = self.model.partition(":")
        return getattr(importlib.import_module(module), attr)


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", f"{_MODELS}.llama:LlamaForCausalLM", "llama",
                     "llama3_json"),
        Architecture("MistralForCausalLM", "llama", f"{_MODELS}.llama:LlamaForCausalLM", None,
                     "mistral"),
        Architecture("Qwen2ForCausalLM", "llama", f"{_MODELS}.llama:LlamaForCausalLM", "qwen2",
                     "hermes"),
        Architecture("Qwen3ForCausalLM", "qwen3", f"{_MODELS}.qwen3:Qwen3ForCausalLM", "qwen3",
                     "hermes"),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe",
                     f"{_MODELS}.qwen3_moe:Qwen3MoeForCausalLM", "qwen3moe", "hermes"),
        Architecture("Gemma3ForCausalLM", "gemma3", f"{_MODELS}.gemma3:Gemma3ForCausalLM",
                     "gemma3", None),
        Architecture("Phi3ForCausalLM", "phi3", f"{_MODELS}.phi3:Phi3ForCausalLM", "phi3", None),
    )
}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)


def get_architecture(name: str) -> Architecture:
    """The table's row for ``name`` (an HF ``architectures`` entry).

    Raises:
        ValueError: an architecture not in the table (the message lists the supported ones).
    """
    arch = ARCHITECTURES.get(name)
    if arch is None:
        hint = ""
        if name == "Gemma3ForConditionalGeneration":
            hint = " (the multimodal Gemma 3; its text-only Gemma3ForCausalLM is supported)"
        raise ValueError(
            f"unsupported architecture {name!r}{hint}; supported: {sorted(ARCHITECTURES)}"
        )
    return arch


def architecture_for_gguf(gguf_name: str) -> Architecture:
    """The row whose GGUF ``general.architecture`` is ``gguf_name``.

    Raises:
        ValueError: no supported architecture has that GGUF name.
    """
    for arch in ARCHITECTURES.values():
        if arch.gguf_name == gguf_name:
            return arch
    names = sorted(a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name)
    raise ValueError(f"unsupported GGUF architecture {gguf_name!r}; supported: {names}")
