"""A LoRA adapter folder in PEFT's format, read and checked: ``adapter_config.json`` and
``adapter_model.safetensors`` (what ``PeftModel.save_pretrained`` writes).

Each adapted module ``m`` of the base model holds ``lora_A [r, in]`` and ``lora_B [out, r]``
and computes ``m(x) + s * (x A^T) B^T`` with ``s = lora_alpha / r``, or ``lora_alpha /
sqrt(r)`` under rsLoRA (Kalajdzievski, arXiv 2312.03732); ``rank_pattern`` and
``alpha_pattern`` set ``r`` and ``lora_alpha`` per module (PEFT's ``LoraConfig``; the rank is
read from the tensors' shapes). Hu et al., "LoRA", arXiv 2106.09685.

What we do not serve is refused by name (:class:`LoraError`): DoRA, LoRA biases, trained
``modules_to_save`` copies, ``fan_in_fan_out`` (GPT-2's Conv1D), embedding adapters, and the
pickle format ``adapter_model.bin`` (loading a pickle runs code from the file).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PeftModelForCausalLM.save_pretrained writes "base_model.model.<base module>.lora_A.weight".
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# Config options whose non-default values change the computation in ways we do not serve.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, [], ()),
    "target_parameters": (None, [], ()),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, [], ()),
    "trainable_token_indices": (None, [], {}, ()),
    "layer_replication": (None, [], ()),
    "use_bdlora": (None, False),
}


class LoraError(ValueError):
    """An adapter this server cannot serve; the message names the adapter's problem."""


@dataclass(frozen=True, slots=True)
class PeftConfig:
    """The parts of ``adapter_config.json`` that set the computation.

    Attributes:
        lora_alpha: the default alpha.
        use_rslora: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``.
        alpha_pattern: module-name pattern -> its alpha (PEFT's matching: the pattern is a
            regex matched against the end of the module's dotted name).
    """

    lora_alpha: float
    use_rslora: bool = False
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def scaling(self, module: str, rank: int) -> float:
        """The factor ``s`` of ``module`` (the base model's dotted name) at rank ``rank``."""
        alpha = self.lora_alpha
        for pattern, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                alpha = value
                break
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)


@dataclass(slots=True)
class PeftModule:
    """One adapted module of the base model.

    Attributes:
        name: its dotted name in the base model (``model.layers.0.self_attn.q_proj``).
        a: ``lora_A [r, in]`` float32.
        b: ``lora_B [out, r]`` float32.
        scaling: ``s`` (:meth:`PeftConfig.scaling`).
    """

    name: str
    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True)
class PeftAdapter:
    """An adapter as read from its folder: its modules and the digest of its files."""

    path: Path
    config: PeftConfig
    modules: list[PeftModule]
    digest: str  # 16 hex digits over the config and weights files' bytes (:func:`adapter_digest`)

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(m.rank for m in self.modules)


def adapter_digest(path: Path) -> str:
    """The identity of the adapter folder ``path``'s contents: 16 hex digits of SHA-256 over
    its config and weights files. Prefill and decode workers that read the same files agree
    on it; two folders with other weights (or a folder rewritten in place) do not.

    Raises:
        LoraError: a file is missing or unreadable.
    """
    h = hashlib.sha256(b"splitserve-lora\0")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        try:
            with open(path / name, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError as exc:
            raise LoraError(f"{path / name}: {exc.strerror or exc}") from exc
        h.update(b"\0")
    return h.hexdigest()[:16]


def read_peft_config(path: Path) -> PeftConfig:
    """``path/adapter_config.json``, checked.

    Raises:
        LoraError: missing folder or file, not JSON, not a LoRA adapter, or an option we do not
            serve (named).
    """
    if not path.is_dir():
        raise LoraError(f"adapter folder {path} does not exist")
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise LoraError(f"{ADAPTER_CONFIG} not found in {path} (a PEFT LoRA adapter folder "
                        "holds adapter_config.json and adapter_model.safetensors)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"{file}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise LoraError(f"{file}: not a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{file}: peft_type {peft_type!r} is not served (only LORA)")
    for option, defaults in _UNSUPPORTED.items():
        if raw.get(option) not in defaults:
            raise LoraError(f"{file}: {option}={raw[option]!r} is not served")
    alpha_pattern = raw.get("alpha_pattern") or {}
    try:
        alpha = float(raw.get("lora_alpha", raw.get("r", 8)))
        pattern = {str(k): float(v) for k, v in alpha_pattern.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise LoraError(f"{file}: lora_alpha or alpha_pattern is not a number ({exc})") from exc
    return PeftConfig(alpha, bool(raw.get("use_rslora", False)), pattern)


def read_adapter(path: str | Path, max_rank: int) -> PeftAdapter:
    """The adapter in folder ``path``, its tensors in float32.

    Args:
        path: a PEFT LoRA folder.
        max_rank: the largest rank served (``--max-lora-rank``).

    Raises:
        LoraError: anything :func:`read_peft_config` refuses; no ``adapter_model.safetensors``
            (``adapter_model.bin`` named as refused); a module with ``lora_A`` but no
            ``lora_B`` (or the reverse), shapes that do not chain, a rank above ``max_rank``,
            embedding adapters, or no LoRA tensor at all.
    """
    path = Path(path)
    config = read_peft_config(path)
    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        why = (" (adapter_model.bin is a pickle, which is not loaded: save with "
               "safe_serialization=True)" if (path / "adapter_model.bin").exists() else "")
        raise LoraError(f"{ADAPTER_WEIGHTS} not found in {path}{why}")
    digest = adapter_digest(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "lora_embedding_" in key:
                    raise LoraError(f"{file}: embedding adapters ({key}) are not served")
                match = _KEY.match(key)
                if match is None:
                    raise LoraError(f"{file}: tensor {key} is not a LoRA weight (lora_A/lora_B); "
                                    "it is not served")
                pairs.setdefault(match["module"], {})[match["ab"]] = f.get_tensor(key).float()
    except LoraError:
        raise
    except Exception as exc:  # a truncated or foreign file: safetensors' own error
        raise LoraError(f"{file}: not a readable safetensors file ({exc})") from exc
    if not pairs:
        raise LoraError(f"{file} holds no LoRA weights")
    modules = []
    for name, ab in sorted(pairs.items()):
        modules.append(_module(file, name, ab, config, max_rank))
    return PeftAdapter(path, config, modules, digest)


def _module(file: Path, name: str, ab: dict[str, torch.Tensor], config: PeftConfig,
            max_rank: int) -> PeftModule:
    if set(ab) != {"A", "B"}:
        missing = "lora_B" if "A" in ab else "lora_A"
        raise LoraError(f"{file}: module {name} has no {missing}")
    a, b = ab["A"], ab["B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoraError(f"{file}: module {name}: lora_A {tuple(a.shape)} and lora_B "
                        f"{tuple(b.shape)} do not make a rank-r product")
    rank = a.shape[0]
    if rank > max_rank:
        raise LoraError(f"rank {rank} of module {name} exceeds --max-lora-rank {max_rank}")
    if rank < 1:
        raise LoraError(f"{file}: module {name} has rank 0")
    return PeftModule(name, a.contiguous(), b.contiguous(), config.scaling(name, rank))
