"""The Triton attention backend: paged decode and extend kernels, for CUDA (and the CPU interpreter).

Registered as ``"triton"`` in ``splitserve.config.registry.ATTENTION`` (imported only when chosen,
so CPU-only runs never import Triton). Kernels: :mod:`splitserve.engine.attention.triton.decode` (one token per sequence,
split-K) and :mod:`splitserve.engine.attention.triton.extend` (several new tokens over a cached prefix).
New K/V are stored with the pool's torch ``index_put`` before either kernel runs (an 8-bit pool
quantizes them there; the kernels de-quantize each block as they read it).

Under ``TRITON_INTERPRET=1`` (set before this module is first imported: Triton decides at
decoration time) the kernels run on CPU tensors, in float32 arithmetic, for tests.

Decode steps are captured as CUDA graphs by :mod:`splitserve.engine.runner.cuda_graph`, which builds its
metadata once per captured batch size with :meth:`TritonAttentionBackend.decode_metadata` (static
index tensors, a fixed split count): the kernels themselves make no host syncs and allocate
nothing but the split partials, so they are capture-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.config import env
from splitserve.engine.attention.base import BaseAttentionBackend, SlidingWindows, layer_windows
from splitserve.engine.attention.triton.decode import choose_num_splits, decode_attention
from splitserve.engine.attention.triton.extend import extend_attention
from splitserve.engine.attention.triton.paged_tile import PagedKV
from splitserve.engine.forward_batch import ForwardBatch
from splitserve.engine.kv_pool import KVPool


@dataclass(slots=True)
class _DecodeRows:
    """The batch's one-token sequences."""

    tok_idx: torch.Tensor  # [Bd] int64 row of the token in q/out
    rows: torch.Tensor  # [Bd] int64 row in the page table
    seq_lens: torch.Tensor  # [Bd] int32
    num_splits: int


@dataclass(slots=True)
class _ExtendRows:
    """The batch's sequences with more than one new token."""

    tok_start: torch.Tensor  # [Be] int32 first row of the new tokens in q/out
    extend_lens: torch.Tensor  # [Be] int32
    seq_lens: torch.Tensor  # [Be] int32
    rows: torch.Tensor  # [Be] int64 row in the page table
    max_extend_len: int


@dataclass(slots=True)
class TritonAttentionMetadata:
    """Index tensors shared by every layer of one forward."""

    batch: ForwardBatch
    decode: _DecodeRows | None
    extend: _ExtendRows | None
    windows: tuple[int | None, ...]  # each layer's sliding window (None: none)
    upcast: bool  # float32 arithmetic (the interpreter cannot do bfloat16 math)


class TritonAttentionBackend(BaseAttentionBackend):
    """Paged attention with Triton kernels; the same contract as the torch backend."""

    supports_cuda_graphs = True

    def __init__(self, interpret: bool | None = None) -> None:
        """Args:
            interpret: the kernels run in Triton's CPU interpreter, so every step computes in
                float32 (the interpreter has no bfloat16 arithmetic). None: as
                ``TRITON_INTERPRET`` says (``config.env.triton_interpret``), the variable Triton
                itself reads when it decorates the kernels.
        """
        self.interpret = env.triton_interpret() if interpret is None else interpret

    def prepare(
        self, batch: ForwardBatch, pool: KVPool, sliding_window: SlidingWindows
    ) -> TritonAttentionMetadata:
        dec_tok: list[int] = []
        dec_rows: list[int] = []
        ext: list[tuple[int, int, int]] = []  # (row, first token, extend_len)
        start = 0
        for i, n in enumerate(batch.extend_lens):
            if n == 1:
                dec_tok.append(start)
                dec_rows.append(i)
            elif n > 1:
                ext.append((i, start, n))
            start += n
        device = batch.input_ids.device

        def as_tensor(xs: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(xs, dtype=dtype, device=device)

        meta = TritonAttentionMetadata(
            batch, None, None, layer_windows(sliding_window, pool.layout.num_layers),
            self.interpret,
        )
        if dec_rows:
            lens = [batch.seq_lens[i] for i in dec_rows]
            splits = choose_num_splits(len(dec_rows), pool.layout.num_kv_heads, max(lens))
            meta.decode = _DecodeRows(
                as_tensor(dec_tok, torch.long),
                as_tensor(dec_rows, torch.long),
                as_tensor(lens, torch.int32),
                splits,
            )
        if ext:
            meta.extend = _ExtendRows(
                as_tensor([s for _, s, _ in ext], torch.int32),
                as_tensor([n for _, _, n in ext], torch.int32),
                as_tensor([batch.seq_lens[i] for i, _, _ in ext], torch.int32),
                as_tensor([i for i, _, _ in ext], torch.long),
                max(n for _, _, n in ext),
            )
        return meta

    def decode_metadata(
        self,
        batch: ForwardBatch,
        seq_lens: torch.Tensor,
        pool: KVPool,
        sliding_window: SlidingWindows,
        max_seq_len: int,
    ) -> TritonAttentionMetadata:
        """See :meth:`BaseAttentionBackend.decode_metadata`; the split count is fixed by
        ``max_seq_len``."""
        rows = torch.arange(batch.batch_size, device=seq_lens.device)
        splits = choose_num_splits(batch.batch_size, pool.layout.num_kv_heads, max_seq_len)
        return TritonAttentionMetadata(
            batch,
            _DecodeRows(rows, rows, seq_lens, splits),
            None,
            layer_windows(sliding_window, pool.layout.num_layers),
            self.interpret,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        meta: TritonAttentionMetadata,
        pool: KVPool,
        scale: float,
    ) -> torch.Tensor:
        batch = meta.batch
        pool.write(layer, batch.out_page_ids, batch.out_offsets, k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kv = PagedKV.of(pool, layer)
        if meta.decode is not None:
            d = meta.decode
            decode_attention(
                q, kv, out, batch.page_table, d.tok_idx, d.rows, d.seq_lens,
                d.num_splits, scale, meta.windows[layer], meta.upcast,
            )  # fmt: skip
        if meta.extend is not None:
            e = meta.extend
            extend_attention(
                q, kv, out, batch.page_table, e.tok_start, e.extend_lens, e.seq_lens,
                e.rows, e.max_extend_len, scale, meta.windows[layer], meta.upcast,
            )  # fmt: skip
        return out


