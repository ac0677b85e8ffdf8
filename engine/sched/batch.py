"""The contract between the scheduler and the model runner, as plain data: what one forward pass
computes (:class:`ScheduledBatch`), what it produced (:class:`ModelOutput`), and what the step
meant for each request (:class:`StepOutput`). The scheduler never runs the model; the runner
never changes a request (as vLLM v1's ``sched/output.py`` separates them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.sched.request import Req


@dataclass(slots=True)
class ScheduledBatch:
    """One forward pass: extend ``reqs[i]`` by ``chunk_lens[i]`` tokens from its ``kv_len``
    (their pages are allocated), and sample one token for each ``reqs[j]``, ``j`` in
    ``sample_rows`` (those whose chunk reaches the end of their sequence). ``scored_rows``: the
    rows whose chunk covers a position that predicts a prompt token whose logprob is still
    wanted (``Req.next_prompt_logprob``). ``drafts``: row -> the speculative draft tokens
    appended to its chunk (a decoding row's chunk is then its missing token plus the draft; the
    runner verifies the draft, ``runner.verify``). ``max_seq_lens``: per row, the most KV the
    sequence can reach on this worker (prompt + ``max_new_tokens`` - 1); empty when unknown, and
    on a prefill worker (its rows leave with their first token). ``interrupt_floor``: the least
    urgent ``priority`` among the rows when the step may be given up between layers for a more
    urgent prompt (:mod:`~splitserve.engine.step_interrupt`); None: it runs whole (speculative
    rows, or a row whose last step was given up)."""

    reqs: list[Req]
    chunk_lens: list[int]
    sample_rows: list[int]
    scored_rows: list[int] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)
    max_seq_lens: list[int] = field(default_factory=list)
    interrupt_floor: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_lens)


@dataclass(slots=True)
class Verified:
    """A verified speculative draft (``runner.verify``): ``tokens`` = the kept draft tokens then
    one more (at least one token), ``logprobs`` their raw log-softmax (temperature 1, no
    filters), ``accepted`` = how many draft tokens were kept."""

    tokens: list[int]
    logprobs: list[float]
    accepted: int


@dataclass(slots=True)
class ModelOutput:
    """What the runner computed for a :class:`ScheduledBatch`: one sampled token and its
    logprob per ``sample_rows`` entry, and for each ``scored_rows`` entry the logprobs of the
    prompt tokens its chunk predicts, in order (float32 log-softmax, before any mask).
    ``verified``: for each row with a draft, every token it gains this step (kept draft tokens
    then one more) and their logprobs; its ``token_ids`` entry is the last of them.

    Alternatives, for the rows whose request asks for ``top_logprobs`` (empty lists for the
    others): ``top_ids[j]`` / ``top_logprobs[j]`` for sampled row ``j``, most likely first;
    ``prompt_top_ids[j]`` / ``prompt_top_logprobs[j]`` one list per scored prompt token. All of
    the raw distribution, like the logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    prompt_logprobs: list[list[float]] = field(default_factory=list)
    verified: dict[int, Verified] = field(default_factory=dict)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_top_ids: list[list[list[int]]] = field(default_factory=list)
    prompt_top_logprobs: list[list[list[float]]] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    """A token sampled for ``req`` this step. ``prefilled`` marks a prefill-only request that just
    stopped computing: it is ``SENDING_KV`` in the scheduler, its pages held until the caller's
    KV send ends (``Scheduler.release``)."""

    req: Req
    token_id: int
    logprob: float
    finished: bool
    prefilled: bool = False
