"""A job: one validated request on its way through the engine and back into a response.

``server.job_builder`` makes one from a request body; ``server.generation`` runs it and records
what the engine sent back on it; ``server.responses`` turns it into the HTTP answer. Features that
change what is asked of the engine add fields to the first group, features that change the answer
add fields to the second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.ipc.messages import LoraRef, SamplingParams
from splitserve.server.formatter import ResponseFormatter, Usage
from splitserve.server.reasoning.request import ReasoningRequest
from splitserve.server.tools.formats import ToolCallFormat

if TYPE_CHECKING:
    from splitserve.observe.timing import RequestTiming
    from splitserve.server.choices import PromptShare
    from splitserve.server.request_trace import RequestTrace


@dataclass(slots=True)
class Job:
    """One validated request, ready to generate.

    ``rid`` is also the response's ``id``; ``stop`` are stop strings (stop token ids are in
    ``sampling``). ``discard_output``: ``max_tokens`` 0 with ``echo`` — the engine always samples a
    first token, which is dropped from the answer.
    """

    # What to generate.
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    # How to answer.
    formatter: ResponseFormatter
    usage: Usage
    return_token_ids: bool = False
    # The LoRA adapter the request's ``model`` named (None: the base model; server.models).
    lora: LoraRef | None = None
    echo_text: str | None = None  # the prompt's text, prepended when ``echo`` (legacy completions)
    # Which logprobs object the answer carries: None, "chat" (``logprobs.content``) or
    # "completion" (the legacy one); the alternatives' count is ``sampling.top_logprobs``.
    logprobs: str | None = None
    discard_output: bool = False
    tool_format: ToolCallFormat | None = None  # parse tool calls out of the answer (chat)
    # name -> ``parameters`` of the request's functions (the XML and pythonic parsers read them)
    tool_functions: dict[str, dict] | None = None
    # A reasoning model's think block (None: the server has no reasoning parser): where the
    # prompt leaves it and what the engine enforces; ``splits_reasoning``: the answer's
    # thinking goes to ``reasoning_content`` (chat), else it stays in the text (completions).
    reasoning: ReasoningRequest | None = None
    splits_reasoning: bool = False
    # Special token ids the answer's text keeps as this text (the tool-call marker where it is
    # a special token, e.g. Mistral's ``[TOOL_CALLS]``: the parser must see it).
    keep_tokens: dict[int, str] = field(default_factory=dict)
    # What came back (filled by ``server.generation.stream_text``). ``*_top_*``: per token its
    # most likely alternatives (when ``sampling.top_logprobs > 0``), most likely first.
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    output_top_ids: list[list[int]] = field(default_factory=list)
    output_top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    # The grammar the workers report they compiled (``TokenEvent.grammar_backend``): the last
    # reporter's backend (disaggregated: the decode worker's, which constrains every token but
    # the first) and the keywords any reporter's backend ignores; "" until a report came.
    grammar_backend: str = ""
    grammar_ignored: list[str] = field(default_factory=list)
    # Tenancy (set by ``server.tenancy`` after the job is built): the tenant (its API key's
    # name; None: shared), whose fair share of the workers the job waits for when they are
    # busy; the prefix-cache namespace the engine matches in (None: the shared one); what to
    # call with the count of each event's generated tokens as they come (the rate limiter
    # charges them there), and once the engine is done with the job, however it ended.
    tenant: str | None = None
    cache_namespace: str | None = None
    on_tokens: Callable[[int], None] | None = None
    # Called when the router's full queue refused the job (429) before it ran: the rate limiter
    # gives back what its admission took (once per prompt: only the job leading it calls it).
    on_refused: Callable[[], None] | None = None
    on_done: Callable[[Job], None] | None = None
    # The answer's choices (``server.choices``): this job's ``choices[].index``, and, for ``n``
    # > 1, the prompt it shares with its siblings (None: it is its prompt's only choice).
    index: int = 0
    share: PromptShare | None = None
    # Observability (server.request_trace, observe.timing): this choice's stage boundaries
    # (None: not timed, e.g. a test's app without the middleware), and the HTTP request's
    # trace (None: not traced).
    timing: RequestTiming | None = None
    trace: RequestTrace | None = None

    @property
    def leads_prompt(self) -> bool:
        """Whether this job is the one that computes its prompt and counts it in ``usage``."""
        return self.share is None or self.share.lead is self
