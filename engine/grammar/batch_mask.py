"""A batch's grammar mask: filled row by row by the constrained requests' matchers, then applied
to the logits of those rows only (unconstrained rows keep their logits bit for bit).

On CPU the fill also expands the bitmask into an additive float bias (0 where a token is allowed,
``-inf`` where not), so that applying the mask after the forward pass is one vectorized add per
run of constrained rows, whatever the mask looks like. xgrammar's CPU kernel writes ``-inf``
token by token instead: ~0.2 ms per row where the grammar allows only a few tokens (after ``{``),
which sits between the logits and the sampler. The expansion itself runs inside ``fill``, which
the model runner overlaps with the forward pass (``mask_thread.py``).

On other devices the bitmask is copied there and applied by xgrammar's kernel (``apply_bitmask``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from splitserve.engine.grammar.bitmask import apply_bitmask, bitmask_width
from splitserve.engine.grammar.request_grammar import RequestGrammar

# Byte value -> the 8 bias values of its bits, lowest bit first (little-endian bit order, as the
# bitmask layout puts token 32w + 8k + j at bit j of byte k of word w on a little-endian CPU).
_BYTE_TO_BIAS = np.where(
    (np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(0.0), np.float32(-np.inf)
).astype(np.float32)


class BatchMask:
    """Reusable mask buffers for one model runner; rows are logits rows.

    Buffers grow to the largest batch seen and are never shrunk, so a step allocates nothing.
    Not thread-safe: ``fill`` and ``apply`` must not run at the same time (the runner joins the
    fill before it applies).

    Args:
        vocab_size: the model's logits width (bitmask width ``ceil(vocab_size / 32)`` words).
        device: where the logits live; ``"cpu"`` uses the float bias (on a little-endian
            machine, which the byte table assumes), others xgrammar's kernel.

    Raises:
        ValueError: if ``vocab_size`` is not positive (a constrained request needs it).
    """

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu") -> None:
        if vocab_size <= 0:
            raise ValueError("a constrained request needs the runner's vocab_size")
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.use_bias = torch.device(device).type == "cpu" and sys.byteorder == "little"
        self.bitmask = torch.empty((0, self.width), dtype=torch.int32)  # int32 [cap, width]
        self._bias = np.empty((0, self.width * 32), dtype=np.float32)  # float32 [cap, 32 * width]
        self._bias_t = torch.from_numpy(self._bias)  # the same memory, for torch ops

    def fill(self, grammars: Sequence[RequestGrammar], rows: Sequence[int]) -> None:
        """Write each grammar's allowed next tokens into its row (and, on CPU, the row's bias).

        Only reads grammar state (matchers' ``fill_bitmask`` does not advance them).

        Args:
            grammars: the constrained requests' grammars, in the order of ``rows``.
            rows: their logits rows, ascending.
        """
        self._reserve(max(rows) + 1)
        for grammar, row in zip(grammars, rows):
            self._fill_row(grammar, row)

    def fill_drafted(
        self, grammars: Sequence[RequestGrammar], starts: Sequence[int], drafts: Sequence[list[int]]
    ) -> None:
        """Speculative rows: for a grammar whose request drafted ``d``, rows
        ``start .. start + len(d)`` get the masks after accepting none, one, ... all of ``d``
        (the matcher is advanced through the draft and rolled back: afterwards it is as before).

        Args:
            grammars: the constrained requests' grammars.
            starts: each one's first logits row, ascending, rows not overlapping.
            drafts: each one's draft, every token of it accepted by its grammar in turn (the
                scheduler trims drafts to that: ``RequestGrammar.accepted_prefix``).

        Raises:
            ValueError: a grammar refused its draft (it changed since the draft was trimmed).
        """
        self._reserve(max(s + len(d) for s, d in zip(starts, drafts)) + 1)
        for grammar, start, draft in zip(grammars, starts, drafts, strict=True):
            for t, token_id in enumerate(draft):
                self._fill_row(grammar, start + t)
                if not grammar.accept(token_id):
                    if t:
                        grammar.matcher.rollback(t)
                    raise ValueError(f"grammar refused draft token {token_id} at {t}")
            self._fill_row(grammar, start + len(draft))
            if draft:
                grammar.matcher.rollback(len(draft))

    def _fill_row(self, grammar: RequestGrammar, row: int) -> None:
        grammar.fill_bitmask(self.bitmask, row)
        if self.use_bias:
            words_as_bytes = self.bitmask.numpy().view(np.uint8)  # [cap, 4 * width]
            # mode="clip": byte indices are always in range, and numpy then writes straight
            # into ``out`` instead of buffering it. [4w] bytes -> [4w, 8] floats.
            out = self._bias[row].reshape(self.width * 4, 8)
            np.take(_BYTE_TO_BIAS, words_as_bytes[row], axis=0, out=out, mode="clip")

    def apply(
        self, logits: torch.Tensor, rows: Sequence[int], mask_rows: Sequence[int] | None = None
    ) -> None:
        """Set the logits of the tokens each row's grammar disallows to ``-inf``, in place.

        Allowed logits get ``+ 0.0``: unchanged (a ``-0.0`` becomes ``+0.0``). Other rows are not
        touched.

        Args:
            logits: float ``[B, V]`` with ``V <= 32 * width``; ``rows`` were filled for them.
            rows: the constrained rows, ascending, as given to the last ``fill``.

            mask_rows: the filled rows to apply to ``rows``, one each, when they differ (a
                speculative step samples a subset of its rows: ``runner.model_runner``).

        Raises:
            ValueError: if the logits are wider than the bitmask covers.
        """
        if not rows:
            return
        if mask_rows is not None and list(mask_rows) != list(rows):
            for row, filled in zip(rows, mask_rows, strict=True):
                self._apply_one(logits, row, filled)
            return
        if logits.shape[-1] > self.width * 32:
            raise ValueError(
                f"logits width {logits.shape[-1]} exceeds the grammar vocab ({self.vocab_size})"
            )
        if not self.use_bias or logits.device.type != "cpu":
            apply_bitmask(logits, self.bitmask[: rows[-1] + 1], rows)
            return
        width = logits.shape[-1]
        if logits.dtype != torch.float32:  # numpy has no bfloat16
            for start, stop in _runs(rows):
                logits[start:stop].add_(self._bias_t[start:stop, :width])
            return
        # numpy adds on this thread only: torch would split these 50k+ elements over its
        # intra-op threads, whose barrier costs milliseconds when the cores are busy (1.8 ms
        # against 0.005 ms for one row, 2 torch threads, load 4.7 on 2 cores).
        values, bias = logits.numpy(), self._bias[:, :width]
        for start, stop in _runs(rows):  # one add per run of adjacent rows: all of them, usually
            np.add(values[start:stop], bias[start:stop], out=values[start:stop])

    def _apply_one(self, logits: torch.Tensor, row: int, filled: int) -> None:
        """Mask ``logits[row]`` with filled row ``filled``."""
        width = logits.shape[-1]
        if self.use_bias and logits.device.type == "cpu":
            logits[row].add_(self._bias_t[filled, :width].to(logits.dtype))
        else:
            apply_bitmask(logits[row : row + 1], self.bitmask[filled : filled + 1], [0])

    def _reserve(self, num_rows: int) -> None:
        """Grow the buffers to at least ``num_rows`` rows (doubling, so growth is rare). The bias
        is checked on its own: ``use_bias`` may be switched on later (bench/grammar.py does)."""
        if num_rows > self.bitmask.shape[0]:
            cap = max(num_rows, 2 * self.bitmask.shape[0])
            self.bitmask = torch.empty((cap, self.width), dtype=torch.int32)
        if self.use_bias and num_rows > self._bias.shape[0]:
            self._bias = np.empty((self.bitmask.shape[0], self.width * 32), dtype=np.float32)
            self._bias_t = torch.from_numpy(self._bias)


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Returns: ``[start, stop)`` ranges covering ascending ``rows``, adjacent rows merged."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs
