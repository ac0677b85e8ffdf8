"""Sending the prefix a batch shares once, ahead of the batch, found from the items' traces."""

from __future__ import annotations

import os

from splitserve.lang.backend import BaseBackend, SamplingArgs, TextPrompt
from splitserve.lang.errors import BackendError, ProgramError
from splitserve.lang.interpreter import execute
from splitserve.lang.state import ProgramState, RunContext, StepFailed
from splitserve.lang.tracer import Trace

MIN_SHARED_CHARS = 32  # below this a warm-up request costs more than it saves


def constant_prompt(backend: BaseBackend, tr: Trace) -> TextPrompt | None:
    """The text prompt an item sends before its first model call (None: not a text prompt)."""
    state = ProgramState(RunContext(backend, "trace", SamplingArgs()))
    try:
        for node in tr.constant_prefix():
            execute(state, node)  # text and roles only: no model call
        prompt = state.prompt()
    except (StepFailed, ProgramError):
        return None
    return prompt if isinstance(prompt, TextPrompt) else None


def warm_shared_prefix(backend: BaseBackend, traces: list[Trace]) -> TextPrompt | None:
    """Prefill the longest text prefix all traces share, if long enough. Returns what was sent
    (None: nothing, or the server failed; the items then report that failure themselves)."""
    if len(traces) < 2:
        return None
    prompts = [constant_prompt(backend, t) for t in traces]
    if any(p is None for p in prompts):
        return None
    texts = [p.text for p in prompts]  # type: ignore[union-attr]
    shared = os.path.commonprefix(texts)
    if len(shared) < MIN_SHARED_CHARS:
        return None
    prompt = TextPrompt(shared, templated=prompts[0].templated)  # type: ignore[union-attr]
    try:
        backend.prefill(prompt)
    except BackendError:
        return None
    return prompt
