"""Which weights a worker loaded: a digest of a fixed sample of every checkpoint tensor's values.

``ModelConfig.fingerprint()`` tells architectures apart, not checkpoints: two fine-tunes of one
base have the same config. The KV handshake also compares this digest (``ipc.messages.WeightsMsg``)
so that a prefill worker does not hand KV to a decode worker of another checkpoint of one shape.

Each tensor is sampled as the loader reads it, before the serving dtype rounds it and before any
``--quantization``: its first and last :data:`SAMPLE` elements and about as many strided through
the rest, hashed with its name, dtype and shape. GGUF tensors are sampled de-quantized (float32),
compressed-tensors ones de-quantized too: the values the model is filled from. The tensors'
digests are combined in name order, so the file and shard order do not matter (a GGUF file and
its exact de-quantization into a safetensors folder agree).

Hashing every byte took 0.4 s for the default model's 513 MiB of float32 and 1.9 s for a 0.5B
model's 2.4 GB; the sample takes about 5 ms for either (more when it is the first to read a
tensor's pages, which the loader reads next anyway). It catches a fine-tune that changes the
values throughout a tensor (full fine-tunes, merged LoRA), not a change confined to a few
elements between the sampled ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import torch

# (HF name, a description for errors, load the tensor): ``engine.model.loader.Tensors``
Tensors = Iterator[tuple[str, str, Callable[[], torch.Tensor]]]

SAMPLE = 1024  # elements from each end of a tensor, and about as many strided between them


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """16 bytes hashing ``name``, ``tensor``'s dtype and shape, and a fixed sample of its
    values' bytes (every value when it has at most ``3 * SAMPLE``)."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n > 3 * SAMPLE:
        step = (n - 2 * SAMPLE) // SAMPLE
        flat = torch.cat((flat[:SAMPLE], flat[SAMPLE : n - SAMPLE : step], flat[n - SAMPLE :]))
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
    h.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


class WeightDigest:
    """Collects the digests of the tensors a loader reads through :meth:`watch`."""

    def __init__(self) -> None:
        self._tensors: dict[str, bytes] = {}

    def watch(self, tensors: Tensors) -> Tensors:
        """``tensors`` unchanged, except that each one loaded is also digested."""
        for name, where, load in tensors:
            yield name, where, lambda name=name, load=load: self._record(name, load())

    def _record(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self._tensors[name] = tensor_digest(name, tensor)
        return tensor

    def hexdigest(self) -> str:
        """16 hex digits over the digests of every tensor loaded so far, in name order."""
        h = hashlib.blake2b(digest_size=8)
        for name in sorted(self._tensors):
            h.update(self._tensors[name])
        return h.hexdigest()
