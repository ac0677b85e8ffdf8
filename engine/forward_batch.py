"""The tensors one model forward pass needs: a ragged batch of sequences, each extending its KV.

A decode step is an extend of one token, so prefill, chunked prefill, prefill over a cached prefix
and decode all use this one structure. Built by ``engine.model_runner``; read by the model and the
attention backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AdapterRows:
    """Which LoRA adapter slot the new tokens of a step run under, grouped by slot: the
    segments of Punica's SGMV (arXiv 2310.18547), each a gather of its rows, two small
    products and a scatter-add (``engine.lora``). Made only for a step where some row has an
    adapter; a base-only step has none (``ForwardBatch.lora`` None), so it runs as without
    LoRA.

    Attributes:
        groups: ``(slot, rows)`` per slot present: ``rows`` a ``slice`` of ``T`` where its
            tokens are consecutive, else an int64 index tensor.
        rows: ``[N]`` int64, the adapted tokens' indices in ``T``, grouped by slot (the C
            kernels' form of ``groups``; on the CPU).
        segments: ``[G, 3]`` int64, per group ``(slot, start in rows, count)`` (on the CPU).
    """

    groups: list[tuple[int, slice | torch.Tensor]]
    rows: torch.Tensor
    segments: torch.Tensor


def adapter_rows(slots: Sequence[int | None], extend_lens: Sequence[int],
                 device: str | torch.device = "cpu") -> AdapterRows | None:
    """The :class:`AdapterRows` of a step whose sequence ``i`` extends by ``extend_lens[i]``
    tokens under adapter slot ``slots[i]`` (None: the base model), or None when no sequence
    has an adapter."""
    if all(s is None for s in slots):
        return None
    by_slot: dict[int, list[int]] = {}
    start = 0
    for slot, n in zip(slots, extend_lens, strict=True):
        if slot is not None:
            by_slot.setdefault(slot, []).extend(range(start, start + n))
        start += n
    groups: list[tuple[int, slice | torch.Tensor]] = []
    rows: list[int] = []
    segments: list[list[int]] = []
    for slot, idx in by_slot.items():
        consecutive = idx[-1] - idx[0] + 1 == len(idx)
        groups.append((slot, slice(idx[0], idx[-1] + 1) if consecutive
                       else torch.tensor(idx, dtype=torch.long, device=device)))
        segments.append([slot, len(rows), len(idx)])
        rows.extend(idx)
    return AdapterRows(groups, torch.tensor(rows, dtype=torch.long),
                       torch.tensor(segments, dtype=torch.long))


@dataclass(slots=True)
class ForwardBatch:
    """One step's inputs.

    Attributes:
        input_ids: ``[T]`` int64, the new tokens of all sequences concatenated in batch order.
        positions: ``[T]`` int64, each new token's position in its sequence.
        extend_lens: ``B`` ints, new tokens per sequence (sum is ``T``).
        seq_lens: ``B`` ints, KV length of each sequence *after* this step (prefix + new).
        page_table: ``[B, max_pages]`` int64 page ids of each sequence; padding entries are 0
            (the pool's scratch page).
        out_page_ids: ``[T]`` int64, page where each new token's K/V is written.
        out_offsets: ``[T]`` int64, slot inside that page.
        logit_indices: ``[N]`` int64 indices into ``T`` whose logits are computed (usually the
            last new token of each sequence that finishes its prompt or decodes).
        seq_ids: ``B`` ints identifying each sequence across steps (unique among live
            sequences, never reused), or None. Attention backends may key caches by them.
            Consecutive one-token rows of one sequence share its id (:meth:`as_decode_rows`).
        logits_every_token: ``logit_indices`` is ``arange(T)`` (a decode step that samples
            every row): the model may score the hidden states without gathering them.
        max_seq_lens: ``B`` ints, the most KV each sequence can reach on this worker (prompt +
            ``max_new_tokens`` - 1), or None when unknown. The decode KV cache reserves room by
            them, so it need not grow in the middle of a sequence's decoding.
        lora: the tokens that run under LoRA adapters, by slot (:class:`AdapterRows`), or
            None: every token runs under the base model.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_lens: list[int]
    seq_lens: list[int]
    page_table: torch.Tensor
    out_page_ids: torch.Tensor
    out_offsets: torch.Tensor
    logit_indices: torch.Tensor
    seq_ids: list[int] | None = None
    logits_every_token: bool = False
    max_seq_lens: list[int] | None = None
    lora: AdapterRows | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence extends by exactly one token."""
        return all(n == 1 for n in self.extend_lens)

    def as_decode_rows(self) -> ForwardBatch:
        """The same step with every new token as a row of its own: ``T`` rows of one token,
        token ``t`` at KV length ``positions[t] + 1`` over its sequence's pages, id and bound.

        Every token keeps its index in ``T``, so ``input_ids``, ``positions``, the write slots
        and ``logit_indices`` are unchanged. Attention is unchanged too where the backend
        writes every row's K/V before any row attends (the decode path does): a row then sees
        its sequence's keys up to its own position, as the causal extend would. Rows of one
        sequence stay consecutive with lengths one apart, and share its ``seq_ids`` entry (the
        decode KV cache gives them one slot). A speculative verify step runs so on the decode
        path (``runner.model_runner``)."""
        lens = self.extend_lens
        seq_lens = [s - n + 1 + t for n, s in zip(lens, self.seq_lens) for t in range(n)]
        rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))

        def repeated(xs: list[int] | None) -> list[int] | None:
            return None if xs is None else [x for x, n in zip(xs, lens) for _ in range(n)]

        return ForwardBatch(
            input_ids=self.input_ids,
            positions=self.positions,
            extend_lens=[1] * len(seq_lens),
            seq_lens=seq_lens,
            page_table=self.page_table[rows.to(self.page_table.device)],
            out_page_ids=self.out_page_ids,
            out_offsets=self.out_offsets,
            logit_indices=self.logit_indices,
            seq_ids=repeated(self.seq_ids),
            logits_every_token=self.logits_every_token,
            max_seq_lens=repeated(self.max_seq_lens),
            lora=self.lora,  # by token, which keeps its index
        )


def build_forward_batch(
    token_chunks: list[list[int]],
    prefix_lens: list[int],
    page_lists: list[list[int]],
    page_size: int,
    logit_seq_indices: list[int],
    device: str | torch.device = "cpu",
    all_logit_seq_indices: Sequence[int] = (),
    seq_ids: list[int] | None = None,
    logit_counts: Sequence[int] | None = None,
    max_seq_lens: list[int] | None = None,
    lora_slots: Sequence[int | None] | None = None,
) -> ForwardBatch:
    """Build a :class:`ForwardBatch`.

    Args:
        token_chunks: per sequence, the new token ids to run this step.
        prefix_lens: per sequence, tokens whose KV is already in the pool.
        page_lists: per sequence, its page ids covering at least ``prefix_len + len(chunk)`` tokens.
        page_size: tokens per page.
        logit_seq_indices: which sequences (by batch index) need logits for their last new token.
        device: where to put the tensors.
        all_logit_seq_indices: sequences that need logits at *every* new token (prompt
            logprobs). Their rows follow the ``logit_seq_indices`` rows, in this order, so the
            first ``len(logit_seq_indices)`` rows of the logits are always the ones to sample.
        seq_ids: per sequence, an id stable across steps (see :class:`ForwardBatch`), or None.
        logit_counts: per entry of ``logit_seq_indices``, how many of its last new tokens get
            logits (default 1; speculative rows verify a draft at every drafted position), in
            position order; so the first rows of the logits are ``sum(logit_counts)`` long.
        max_seq_lens: per sequence, the most KV it can reach here (see :class:`ForwardBatch`).
        lora_slots: per sequence, the LoRA adapter slot it runs under (None: the base model),
            or None when no sequence has one.

    Raises:
        ValueError: a sequence's pages cannot hold its tokens.
    """
    ids: list[int] = []
    positions: list[int] = []
    out_pages: list[int] = []
    out_offsets: list[int] = []
    extend_lens: list[int] = []
    seq_lens: list[int] = []
    ends: list[int] = []
    starts: list[int] = []
    for chunk, prefix_len, pages in zip(token_chunks, prefix_lens, page_lists, strict=True):
        seq_len = prefix_len + len(chunk)
        if len(pages) * page_size < seq_len:
            raise ValueError(f"{len(pages)} pages of {page_size} cannot hold {seq_len} tokens")
        starts.append(len(ids))
        ids.extend(chunk)
        pos = range(prefix_len, seq_len)
        positions.extend(pos)
        out_pages.extend(pages[p // page_size] for p in pos)
        out_offsets.extend(p % page_size for p in pos)
        extend_lens.append(len(chunk))
        seq_lens.append(seq_len)
        ends.append(len(ids) - 1)
    # One tensor from padded lists: per-row tensor building costs ~5 us a row in small ops.
    width = max(max((len(p) for p in page_lists), default=0), 1)
    table = torch.tensor([p + [0] * (width - len(p)) for p in page_lists], dtype=torch.long)
    table = table.view(len(page_lists), width)

    def as_long(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=device)

    logit_rows = (
        [ends[i] for i in logit_seq_indices]
        if logit_counts is None
        else [
            t
            for i, c in zip(logit_seq_indices, logit_counts, strict=True)
            for t in range(ends[i] - c + 1, ends[i] + 1)
        ]
    ) + [t for i in all_logit_seq_indices for t in range(starts[i], ends[i] + 1)]

    return ForwardBatch(
        input_ids=as_long(ids),
        positions=as_long(positions),
        extend_lens=extend_lens,
        seq_lens=seq_lens,
        page_table=table.to(device),
        out_page_ids=as_long(out_pages),
        out_offsets=as_long(out_offsets),
        logit_indices=as_long(logit_rows),
        seq_ids=seq_ids,
        logits_every_token=logit_rows == list(range(len(ids))),
        max_seq_lens=max_seq_lens,
        lora=None if lora_slots is None else adapter_rows(lora_slots, extend_lens, device),
    )
