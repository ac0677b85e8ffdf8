"""Open a GGUF file with the ``gguf`` package's reader and check it before anything loads it.

A file is refused, with its path and the cause, when it is not GGUF, is truncated (the header or
a tensor's data runs past the end), or holds a tensor of a type we do not de-quantize. The checks
read only the header and tensor table (the data is memory-mapped), so they run at launch.

Each tensor keeps its GGML type (:attr:`GGUFFile.tensor_types`): a loader that keeps a tensor
quantized (rather than de-quantizing it to the serving dtype, as :func:`dequantize` does) can
tell which it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Types we de-quantize (through gguf.quants.dequantize): the float types and llama.cpp's legacy
# and k-quant block types. F32/F16/BF16/Q8_0/Q4_0/Q5_0 are tested on files written here, and
# Q4_K/Q5_0/Q6_K/Q8_0 in the real Gemma-3-270M and Qwen2.5-Coder-0.5B files; the rest share
# gguf's code paths. The i-quants, ternary and FP4 types are refused: nothing here tests them.
SUPPORTED_TENSOR_TYPES = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
})
GGUF_MAGIC = b"GGUF"
DEQUANT_ROWS = 1024  # rows de-quantized at a time


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file and the cause."""


@dataclass
class GGUFFile:
    """A checked GGUF file.

    Attributes:
        path: the file.
        reader: the ``gguf.GGUFReader`` over it (memory-mapped).
        architecture: ``general.architecture`` (``llama``, ``qwen2``, ``gemma3`` ...).
        tensors: tensor name -> the reader's tensor (``.data`` is the raw, still quantized
            memory-mapped array).
        tensor_types: tensor name -> GGML type name (``Q4_K``).
    """

    path: Path
    reader: Any
    architecture: str
    tensors: dict[str, Any] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value at ``key`` (a str, number, bool or list), or ``default``."""
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        """``field(f"{architecture}.{key}")``."""
        return self.field(f"{self.architecture}.{key}", default)

    def dequantize(self, name: str) -> torch.Tensor:
        """Tensor ``name`` de-quantized to float32, in PyTorch's shape order (``[out, in]``
        for a weight: GGUF lists dimensions innermost first)."""
        from gguf.quants import dequantize  # type: ignore[import-untyped]

        t = self.tensors[name]
        data = t.data  # [rows, bytes per row] for a block type, [rows, row] for a float type
        if data.ndim < 2:
            return torch.from_numpy(np.array(dequantize(data, t.tensor_type), np.float32))
        # Row blocks, each de-quantized into its place: gguf's numpy temporaries then stay
        # small (a whole 150k-row embedding would make several copies of ~0.5 GB each).
        first = dequantize(data[:1], t.tensor_type)
        out = np.empty((*data.shape[:-1], first.shape[-1]), dtype=np.float32)
        flat_in = data.reshape(-1, data.shape[-1])
        flat_out = out.reshape(-1, out.shape[-1])
        for start in range(0, flat_in.shape[0], DEQUANT_ROWS):
            block = flat_in[start : start + DEQUANT_ROWS]
            flat_out[start : start + block.shape[0]] = dequantize(block, t.tensor_type)
        return torch.from_numpy(out)


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and check ``path``.

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not a GGUF file, truncated, or a tensor of an unsupported type.
    """
    from gguf import GGUFReader  # type: ignore[import-untyped]

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader fails in many ways on a cut file (IndexError, ...)
        raise GGUFError(
            f"{path}: unreadable GGUF file, truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from exc
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise GGUFError(f"{path}: GGUF metadata has no general.architecture")
    gguf = GGUFFile(path, reader, str(arch_field.contents()))
    size = path.stat().st_size
    unsupported: dict[str, str] = {}
    for t in reader.tensors:
        type_name = t.tensor_type.name
        gguf.tensors[t.name] = t
        gguf.tensor_types[t.name] = type_name
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"{path}: truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )
        if type_name not in SUPPORTED_TENSOR_TYPES:
            unsupported.setdefault(type_name, t.name)
    if unsupported:
        kinds = ", ".join(f"{k} (e.g. {v})" for k, v in sorted(unsupported.items()))
        raise GGUFError(
            f"{path}: unsupported tensor type {kinds}; supported: "
            f"{', '.join(sorted(SUPPORTED_TENSOR_TYPES))}"
        )
    return gguf
