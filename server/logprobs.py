"""The legacy-completions ``logprobs`` object: per token its string, logprob and text offset.

OpenAI's shape is ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; with ``echo``
the prompt's tokens come first and the first prompt token's logprob is null (nothing predicts
it). ``top_logprobs`` is null here: the workers return only the logprob of the actual token.
"""

from __future__ import annotations

from typing import Any


def logprobs_object(
    tokenizer: Any,
    prompt_ids: list[int],
    prompt_logprobs: list[float] | None,
    logprob_start_len: int,
    output_ids: list[int],
    output_logprobs: list[float],
) -> dict[str, Any]:
    """Build the object.

    Args:
        tokenizer: decodes each token to its string.
        prompt_ids: the prompt's ids when echoed, else empty.
        prompt_logprobs: logprobs of ``prompt_ids[max(1, logprob_start_len):]``.
        logprob_start_len: first prompt index that was scored (earlier ones are null).
        output_ids / output_logprobs: the generated tokens and their logprobs.
    """
    start = max(1, logprob_start_len)
    scored = list(prompt_logprobs or [])
    prompt_lps: list[float | None] = [None] * min(start, len(prompt_ids)) + scored
    prompt_lps = (prompt_lps + [None] * len(prompt_ids))[: len(prompt_ids)]
    ids = list(prompt_ids) + list(output_ids)
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": prompt_lps + list(output_logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }
