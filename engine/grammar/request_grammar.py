"""One request's grammar as the scheduler drives it: mask, accept, end, jump forward.

Wraps a ``BaseMatcher`` with the two things the scheduler needs beyond it: deciding that the
output must end now (only a stop token is allowed, so sampling it would waste a forward pass),
and turning a forced continuation (``find_jump_forward_string``) into tokens to append unsampled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.engine.grammar.base import BaseMatcher
from splitserve.engine.grammar.bitmask import bitmask_width


class RequestGrammar:
    """Grammar state of one request.

    Args:
        matcher: a fresh matcher from the request's ``CompiledGrammar``.
        vocab_size: the model's logits width (bitmask width).
        stop_token_ids: the tokens the backend treats as "end of output".
        encode: text -> token ids without special tokens (the model's tokenizer), for
            jump-forward; None turns jump-forward off for this request.
    """

    def __init__(
        self,
        matcher: BaseMatcher,
        vocab_size: int,
        stop_token_ids: list[int],
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.encode = encode
        self._scratch = torch.empty((1, bitmask_width(vocab_size)), dtype=torch.int32)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""
        self.matcher.fill_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token. Returns: False if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def accepted_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from its current state, short of
        one that terminates it (a stop token: after it there is no next mask to fill, and the
        model samples it in the next step); the state is left as it was (for speculative
        drafts).

        Requires a matcher made with ``max_rollback_tokens >= len(tokens)``.
        """
        n = 0
        for token_id in tokens:
            if not self.matcher.accept_token(token_id):
                break
            n += 1
            if self.matcher.is_terminated():
                break
        if n:
            terminated = self.matcher.is_terminated()
            self.matcher.rollback(n)
            n -= terminated
        return n

    def must_end(self) -> bool:
        """True when the output is complete and nothing but a stop token may follow.

        A terminated matcher (a stop token was accepted) must end too. Otherwise this fills one
        mask row, which costs microseconds, far less than the forward pass it saves.
        """
        if self.matcher.is_terminated():
            return True
        if not self.matcher.can_end():
            return False
        self._scratch.fill_(-1)
        self.matcher.fill_bitmask(self._scratch, 0)
        words = self._scratch[0].clone()
        for token_id in self.stop_token_ids:  # clear the stop bits; anything left is text
            if token_id < self.vocab_size:
                words[token_id // 32] &= ~_bit(token_id % 32)
        # Bits past the vocabulary in the last word are padding, not tokens.
        tail = self.vocab_size % 32
        if tail:
            words[-1] &= _bit(tail) - 1 if tail < 31 else 0x7FFFFFFF
        return not bool(words.any())

    def forced_tokens(self, limit: int) -> list[int]:
        """Tokens the grammar forces next, already accepted by the matcher (jump-forward).

        First the exact ids the matcher forces (``BaseMatcher.forced_token_ids``: a think
        block's end marker once its budget is spent), then its forced text. The text is
        conservative by design: it is tokenized on its own, and its last token is held back for
        the model to sample, because that is where the model's own tokenization would merge
        the forced text with what follows (``name"`` then ``:`` is sampled as ``":``). Tokens
        the matcher refuses (a tokenizer that normalizes text) undo that part of the jump.

        Args:
            limit: at most this many tokens (what ``max_new_tokens`` still allows).

        Returns:
            The accepted tokens, possibly empty.
        """
        if self.encode is None or limit <= 0:
            return []
        exact: list[int] = []
        while len(exact) < limit:
            ids = self.matcher.forced_token_ids()[: limit - len(exact)]
            if not ids:
                break
            for n, token_id in enumerate(ids):
                if not self.matcher.accept_token(token_id):
                    if n:
                        self.matcher.rollback(n)
                    return exact
            exact += ids
        limit -= len(exact)
        text = self.matcher.find_jump_forward_string() if limit > 0 else ""
        if not text:
            return exact
        tokens = self.encode(text)[:-1][:limit]
        for n, token_id in enumerate(tokens):
            if token_id in self.stop_token_ids or not self.matcher.accept_token(token_id):
                if n:
                    self.matcher.rollback(n)
                return exact
        return exact + tokens


def _bit(position: int) -> int:
    """Returns: ``1 << position`` as a signed int32 value."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
