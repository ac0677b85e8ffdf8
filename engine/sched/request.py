"""One request's state inside a worker's scheduler."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitserve.ipc.messages import SamplingParams, StageStamps

if TYPE_CHECKING:
    from splitserve.engine.grammar.request_grammar import RequestGrammar
    from splitserve.engine.lora.manager import LoadedAdapter
    from splitserve.engine.sched.ngram import NgramIndex

# Process-wide counter for Req.uid: unlike rid (client-chosen, may repeat) or id() (reused after
# garbage collection), a uid names one Req object for the life of the process.
_uids = itertools.count()


@dataclass(slots=True, eq=False)
class Req:
    """A sequence being prefilled or decoded.

    The sequence is ``input_ids + output_ids``. ``kv_len`` counts the leading tokens whose K/V is
    in the pool (in ``page_ids``). A step extends ``fill_ids[kv_len:]`` (or a chunk of it); when
    that reaches the end of the sequence the next token is sampled. Decode is the case where one
    token (the last sampled one) is missing its KV. A retracted request has ``kv_len = 0`` and is
    prefilled again over prompt + output, which continues exactly where it stopped.
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    reply_addr: str = ""
    # Prefix-cache namespace: the tenant's, with the LoRA adapter folded in (a prefix computed
    # under one adapter is no other's); None: the shared one, base model.
    cache_namespace: str | None = None
    lora: LoadedAdapter | None = None  # the LoRA adapter it runs under (None: the base model)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    kv_len: int = 0
    cached_len: int = 0  # prompt tokens served from a prefix cache (reported to the client)
    # Of ``cached_len``, the tokens each cache tier served (radix_cache.tiers: "l1" the pool,
    # "l2" host memory, "l3" disk, "store" the shared store); empty when no tier is configured.
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    matched_len: int = 0  # leading tokens whose pages the prefix cache lent at this admission
    locked_node: object | None = None  # the prefix cache's pin on those pages (radix TreeNode)
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    emitted_len: int = 0  # output tokens already sent to the server
    # Logprobs of prompt tokens from ``prompt_logprob_start`` on, filled chunk by chunk.
    prompt_logprobs: list[float] = field(default_factory=list)
    # When ``sampling.top_logprobs > 0``: per output (resp. scored prompt) token, the most likely
    # ids and their raw logprobs; kept in step with ``output_ids`` by :meth:`append_output`.
    output_top_ids: list[list[int]] = field(default_factory=list)
    output_top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    grammar: RequestGrammar | None = None  # set once its constraint compiled (None: free text)
    # (backend, ignored keywords) of the compile ``grammar`` came from, until this worker's first
    # output for the request reports it (``worker.outputs.token_output``); None: nothing to report.
    grammar_report: tuple[str, tuple[str, ...]] | None = None
    uid: int = field(default_factory=lambda: next(_uids))  # keys per-sequence engine caches
    ngrams: NgramIndex | None = None  # speculative drafts' index, made at its first decode step
    lora_slot: int | None = None  # its adapter's slot while admitted (engine.lora.slots)
    # Its last step was given up for a more urgent prompt (engine.step_interrupt): its next
    # step runs whole, so that a stream of urgent arrivals cannot starve it.
    given_up: bool = False
    # When it passed each stage boundary here (wall clock; the worker stamps them, the router
    # gets them with its first and last outputs), and its trace record when it is traced
    # (``worker.tracing.ReqTrace``; None: not traced). The engine never reads either.
    stamps: StageStamps = field(default_factory=StageStamps)
    trace: Any = None

    @property
    def lora_id(self) -> str:
        """Its adapter's identity (the digest of its files; "" for the base model): the KV
        handoff checks that both workers run the same."""
        return "" if self.lora is None else self.lora.digest

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence so far (prompt + generated)."""
        return len(self.input_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        """Tokens still missing their KV."""
        return self.seq_len - self.kv_len

    @property
    def prompt_logprob_start(self) -> int:
        """First prompt index that gets a logprob (index 0 has no context to score it)."""
        return max(1, self.sampling.logprob_start_len)

    @property
    def next_prompt_logprob(self) -> int | None:
        """Prompt index whose logprob is still missing, or None when none are (left) to compute.

        Kept as a count, not recomputed from ``kv_len``, so a retracted request that is prefilled
        again does not score its prompt twice.
        """
        if not self.sampling.wants_prompt_logprobs:
            return None
        nxt = self.prompt_logprob_start + len(self.prompt_logprobs)
        return nxt if nxt < self.prompt_len else None

    def append_output(
        self,
        token_id: int,
        logprob: float,
        top_ids: list[int] | None = None,
        top_logprobs: list[float] | None = None,
    ) -> None:
        """Append one generated token with its logprob (and its alternatives when the request
        asks for them; a token that was not sampled here gets none)."""
        self.output_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if self.sampling.top_logprobs > 0:
            self.output_top_ids.append(top_ids or [])
            self.output_top_logprobs.append(top_logprobs or [])

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + output, without building the whole list."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]

    def check_finished(self, eos_token_ids: frozenset[int]) -> str | None:
        """Set and return ``finish_reason`` after a token was appended: ``stop`` or ``length``."""
        s = self.sampling
        last = self.output_ids[-1]
        # Before min_tokens EOS and stop ids are masked; one the grammar forced does not stop.
        may_stop = len(self.output_ids) > s.min_tokens  # the last token's index >= min_tokens
        if may_stop and (
            (not s.ignore_eos and last in eos_token_ids) or last in s.stop_token_ids
        ):
            self.finish_reason = "stop"
        elif self.grammar is not None and self.grammar.must_end():
            self.finish_reason = "stop"  # the grammar is complete; only a stop token could follow
        elif len(self.output_ids) >= s.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason
