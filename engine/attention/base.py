"""The attention backend interface: how a model attends over the paged KV pool.

A model forward calls :meth:`BaseAttentionBackend.prepare` once per batch (index tensors and masks
shared by every layer), then :meth:`BaseAttentionBackend.forward` once per layer. ``forward``
first stores the new tokens' K/V in the pool, then lets every new token at position ``p`` attend to
its own sequence's keys ``0..p`` (cached prefix plus the new tokens, causal), optionally limited to
a sliding window of the last ``W`` positions (keys ``p - W < j <= p``). The window may differ per
layer (Gemma 3 interleaves windowed layers with global ones): ``sliding_window`` is then one
entry per layer, normalized by :func:`layer_windows`.

Backends are chosen by name (``splitserve.config.registry.ATTENTION``): ``torch``
(:mod:`~splitserve.engine.attention.torch_backend`) and ``triton``
(:mod:`~splitserve.engine.attention.triton.backend`, imported only when chosen, so CPU-only runs
never import Triton). A backend that can be captured in a CUDA graph says so with
:attr:`BaseAttentionBackend.supports_cuda_graphs` and implements :meth:`decode_metadata`; one
that the fused C decode layers (``engine.model.fused_decode``) attend through says so with
:meth:`BaseAttentionBackend.serves_fused_decode` and implements
:meth:`BaseAttentionBackend.fused_decode_targets`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from splitserve.config.registry import ATTENTION
from splitserve.engine.attention.decode_kv_cache import StepTargets
from splitserve.engine.forward_batch import ForwardBatch
from splitserve.engine.kv_pool import KVPool

# One window for every layer (None: no window), or one entry per layer.
SlidingWindows = int | None | Sequence[int | None]


def layer_windows(sliding_window: SlidingWindows, num_layers: int) -> tuple[int | None, ...]:
    """The window of each of ``num_layers`` layers (None: attends to every earlier key).

    Raises:
        ValueError: a per-layer sequence of the wrong length, or a window below 1.
    """
    if sliding_window is None or isinstance(sliding_window, int):
        windows: tuple[int | None, ...] = (sliding_window,) * num_layers
    else:
        windows = tuple(sliding_window)
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} sliding windows for {num_layers} layers")
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding windows must be at least 1, got {windows}")
    return windows


class BaseAttentionBackend(ABC):
    """Paged attention for one worker. The pool is the only KV state between batches (a backend
    may keep a cache of it, as the torch backend does for decode rows)."""

    def cache_bytes(self) -> int:
        """Bytes this backend holds besides the pool (a copy of the decoding rows' K/V)."""
        return 0

    @abstractmethod
    def prepare(self, batch: ForwardBatch, pool: KVPool, sliding_window: SlidingWindows) -> Any:
        """Build what every layer of one forward over ``batch`` needs (index tensors, masks).

        Args:
            batch: the step's inputs.
            pool: the KV pool the batch's page ids index.
            sliding_window: attend only to the last ``sliding_window`` positions, or None; or
                one such entry per layer of the pool (:func:`layer_windows`).

        Returns:
            Backend-specific metadata, passed unchanged to :meth:`forward`.
        """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        meta: Any,
        pool: KVPool,
        scale: float,
    ) -> torch.Tensor:
        """Write ``k``/``v`` into the pool at ``layer``, then attend.

        Args:
            q: ``[T, Hq, D]`` queries of the new tokens (RoPE applied).
            k: ``[T, Hkv, D]`` keys of the new tokens (RoPE applied); ``Hq % Hkv == 0``.
            v: ``[T, Hkv, D]`` values of the new tokens.
            layer: layer index into the pool.
            meta: what :meth:`prepare` returned for this batch.
            pool: the KV pool.
            scale: softmax scale, usually ``D ** -0.5``.

        Returns:
            ``[T, Hq, D]`` attention output in ``q``'s dtype.
        """

    # ---- CUDA graphs (engine.runner.cuda_graph) -------------------------------------------

    supports_cuda_graphs: bool = False  # implements decode_metadata over static buffers

    def decode_metadata(
        self,
        batch: ForwardBatch,
        seq_lens: torch.Tensor,
        pool: KVPool,
        sliding_window: SlidingWindows,
        max_seq_len: int,
    ) -> Any:
        """Metadata for a decode-only ``batch`` of caller-owned static tensors, reusable across
        steps whose inputs are copied into those same tensors (CUDA-graph replay).

        Args:
            batch: ``B`` one-token rows; row ``i``'s token is ``q[i]``, its pages
                ``batch.page_table[i]``.
            seq_lens: ``[B]`` int32 KV length per row (new token included), updated in place
                before each step.
            pool: the KV pool.
            sliding_window: as for :meth:`prepare` (one window, or one per layer).
            max_seq_len: the longest KV length a step may have (fixes the kernel's work split).

        Raises:
            NotImplementedError: the backend cannot be captured (``supports_cuda_graphs`` False).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    # ---- the fused C decode layers (engine.model.fused_decode) ---------------------------------

    def serves_fused_decode(self, pool: KVPool, num_heads: int) -> bool:
        """Whether the fused C decode layers can attend through this backend over ``pool``
        with ``num_heads`` query heads: a contiguous K/V copy of the decoding rows that they
        append to and read, and C kernels for the pool's dtype and heads. Known before a step
        (the step planner asks: ``engine.step_plan``). Default: no."""
        return False

    def fused_decode_targets(self, meta: Any) -> StepTargets | None:
        """For a decode-only step's metadata (from :meth:`prepare`), where the fused layers
        append and read its rows, that step's appends counting as done; None when this step's
        rows have no such place (the copy did not fit its memory bound): the layers then run
        one by one. Only called where :meth:`serves_fused_decode` holds. Default: None."""
        return None


def create_attention_backend(name: str = "torch", **options: Any) -> BaseAttentionBackend:
    """Instantiate a registered backend by name; ``options`` go to its constructor (the torch
    backend's ``use_decode_cache`` and ``use_cpu_kernels``).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    return ATTENTION.load(name)(**options)


def default_attention_backend(device: str | torch.device, choice: str = "auto") -> str:
    """The backend name for tensors on ``device``: ``choice`` unless ``auto``, else ``triton``
    on CUDA and ``torch`` elsewhere (Triton's CPU path is only an interpreter)."""
    if choice != "auto":
        return choice
    return "triton" if torch.device(device).type == "cuda" else "torch"
