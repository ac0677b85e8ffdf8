"""A request's tokens as the router receives them (``TokenOutput``). Shared by every role's
policy: the prefill worker sends the first token, the decode and colocated workers the rest."""

from __future__ import annotations

import time

from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import TokenOutput


def token_output(req: Req, index: int) -> TokenOutput:
    """``req``'s output tokens from output position ``index`` to the end, with their logprobs
    and alternatives; the first output (``index`` 0) also carries the prompt's logprobs.

    The first output made here for ``req`` after its grammar compiled also carries which
    backend compiled it and what that backend ignores (``Req.grammar_report``, cleared: each
    worker reports its own compile once), so make one only to send it."""
    wants_prompt_top = req.sampling.wants_prompt_logprobs and req.sampling.top_logprobs > 0
    report, req.grammar_report = req.grammar_report, None
    backend, ignored = report if report is not None else ("", ())
    return TokenOutput(
        rid=req.rid,
        index=index,
        token_ids=req.output_ids[index:],
        logprobs=req.output_logprobs[index:],
        finish_reason=req.finish_reason,
        prompt_len=req.prompt_len,
        cached_len=req.cached_len,
        cached_by_tier=req.cached_by_tier if index == 0 else {},
        # The first output carries them: from the prefill worker when disaggregated.
        prompt_logprobs=(
            req.prompt_logprobs if index == 0 and req.sampling.wants_prompt_logprobs else None
        ),
        top_ids=req.output_top_ids[index:],
        top_logprobs=req.output_top_logprobs[index:],
        prompt_top_ids=req.prompt_top_ids if index == 0 and wants_prompt_top else None,
        prompt_top_logprobs=req.prompt_top_logprobs if index == 0 and wants_prompt_top else None,
        # The stage stamps go with the first and the last output (observe.timing).
        stamps=req.stamps if index == 0 or req.finish_reason is not None else None,
        grammar_backend=backend,
        grammar_ignored=list(ignored),
    )


def decoded_outputs(outputs: list[StepOutput]) -> list[tuple[str, TokenOutput]]:
    """``(reply_addr, output)`` of each step output's tokens not yet sent (jump-forward ones
    included); marks them sent (``Req.emitted_len``) and stamps the request's decode stages
    (its first decode step, its last token: ``Req.stamps``)."""
    emitted = []
    now = 0.0
    for out in outputs:
        req = out.req
        stamps = req.stamps
        if req.finish_reason is not None or not stamps.first_step:
            now = now or time.time()
            if not stamps.first_step and req.emitted_len:  # a decode step, not the prompt's
                stamps.first_step = now
            if req.finish_reason is not None:
                stamps.last = now
        emitted.append((req.reply_addr, token_output(req, req.emitted_len)))
        req.emitted_len = len(req.output_ids)
    return emitted
