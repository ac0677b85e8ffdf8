"""The two OpenAI logprobs objects, from what the workers returned per token (its logprob and its
most likely alternatives, all of the raw distribution):

- legacy completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; with
  ``echo`` the prompt's tokens come first and the first prompt token's entries are null
  (nothing predicts it). ``top_logprobs[i]`` maps token text to logprob: the ``logprobs`` most
  likely tokens plus the chosen one (OpenAI: "up to logprobs + 1 elements").
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...]}``.
"""

from __future__ import annotations

from typing import Any

from splitserve.server.token_text import TokenSpeller


def completion_logprobs(
    speller: TokenSpeller,
    ids: list[int],
    logprobs: list[float] | list[float | None],
    top_ids: list[list[int]] | None,
    top_logprobs: list[list[float]] | None,
    text_offset: int = 0,
) -> dict[str, Any]:
    """The legacy object of tokens ``ids``.

    Args:
        speller: spells each token.
        ids: the tokens (echoed prompt, then output; or one streamed chunk's tokens).
        logprobs: one per id; None where the token was not scored (``top_logprobs`` null too).
        top_ids / top_logprobs: per id its alternatives (lists may be empty); None when the
            request asked for none: each entry then holds only the chosen token.
        text_offset: character offset of the first token in the choice's text.
    """
    tokens = [speller.text_of(t) for t in ids]
    offsets, pos = [], text_offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    tops: list[dict[str, float] | None] = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        if lp is None:
            tops.append(None)
            continue
        # The chosen token first: an alternative whose text collides with it keeps its own
        # (higher) value, so "is the chosen token the most likely" stays answerable.
        top = {tok: lp}
        alt_ids = top_ids[i] if top_ids is not None and i < len(top_ids) else []
        alt_lps = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else []
        for t, v in zip(alt_ids, alt_lps):
            top[speller.text_of(t)] = v
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echoed_prompt_scores(
    num_prompt: int,
    logprob_start_len: int,
    prompt_logprobs: list[float] | None,
    prompt_top_ids: list[list[int]] | None,
    prompt_top_logprobs: list[list[float]] | None,
) -> tuple[list[float | None], list[list[int]], list[list[float]]]:
    """Per prompt token its logprob (None before ``max(1, logprob_start_len)``: not scored) and
    alternatives, aligned to the prompt's ``num_prompt`` tokens."""
    start = min(max(1, logprob_start_len), num_prompt)
    n = num_prompt - start
    scored = list(prompt_logprobs or [])[:n]
    lps: list[float | None] = [None] * start + scored + [None] * (n - len(scored))

    def aligned(rows: list[list[Any]] | None) -> list[list[Any]]:
        rows = list(rows or [])[:n]
        return [[] for _ in range(start)] + rows + [[] for _ in range(n - len(rows))]

    return lps, aligned(prompt_top_ids), aligned(prompt_top_logprobs)


def chat_logprobs(
    speller: TokenSpeller,
    ids: list[int],
    logprobs: list[float],
    top_ids: list[list[int]],
    top_logprobs: list[list[float]],
) -> dict[str, Any]:
    """The chat object of output tokens ``ids``; ``top_ids``/``top_logprobs`` per id (empty
    lists, or shorter than ``ids``, when none were asked for)."""
    content = []
    for i, (tok, lp) in enumerate(zip(ids, logprobs)):
        alts = zip(top_ids[i], top_logprobs[i]) if i < len(top_ids) else ()
        content.append({
            **_chat_entry(speller, tok, lp),
            "top_logprobs": [_chat_entry(speller, t, v) for t, v in alts],
        })
    return {"content": content}


def _chat_entry(speller: TokenSpeller, token_id: int, logprob: float) -> dict[str, Any]:
    raw = speller.bytes_of(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
            "bytes": list(raw)}
