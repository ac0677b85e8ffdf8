"""What a request asks of the worker that runs it, as ``GenerateTask`` carries it: how to pick
each token (:class:`SamplingParams`, with its grammar :class:`Constraint` and a reasoning model's
think block :class:`ReasoningParams`) and the LoRA adapter it runs under (:class:`LoraRef`).

Plain structs without a tag: they travel inside the messages of ``ipc.messages``, never alone.
"""

from __future__ import annotations

import msgspec


class Constraint(msgspec.Struct, frozen=True):
    """A grammar the output must match (docs/design.md, "Structured generation").

    ``kind`` is one of ``engine.grammar.GRAMMAR_KINDS``: ``json_schema`` (``text`` is the schema
    as JSON), ``json_object`` (``text`` ignored), ``regex``, ``ebnf`` (a GBNF grammar with a
    ``root`` rule), ``choice`` (``text`` is a JSON list of strings) or ``structural_tag``
    (xgrammar's structural tag JSON: the tool-call envelope, ``server.tools.grammar``).
    """

    kind: str
    text: str = ""
    # json_schema: only a backend that enforces every keyword may compile it (else a 400).
    strict: bool = False
    # JSON kinds: free whitespace between tokens (the default is compact JSON).
    whitespace_flexible: bool = False


class ReasoningParams(msgspec.Struct, frozen=True):
    """The think block of a reasoning model's answer, as the engine enforces it (docs/api.md,
    "Reasoning"): the request's constraint starts only after the block, and the block ends by
    force after ``budget`` tokens. Sent only where the engine has something to do: a
    constraint, or a budget (free thinking without a budget is the server's parsing alone).

    ``start_ids`` / ``end_ids``: the markers as the model's tokenizer writes them on their own
    (a model opens the block with exactly ``start_ids``; the budget forces exactly ``end_ids``);
    ``end_text``: the end marker's text, found in the output at the byte level whatever tokens
    spell it; ``opened``: the prompt opened the block, so the answer starts inside it (else the
    model may open it as its first tokens); ``budget``: thinking tokens at most, -1 for none.
    """

    start_ids: list[int]
    end_ids: list[int]
    end_text: str
    opened: bool
    budget: int = -1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token. Units: tokens.

    ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0`` disable those filters;
    ``temperature == 0`` is greedy. Generation stops at ``max_new_tokens`` (finish ``length``),
    at an EOS id of the model unless ``ignore_eos``, or at any of ``stop_token_ids`` (finish ``stop``).
    ``constraint`` rides here (as in SGLang/vLLM) so it reaches every worker's ``Req`` with the
    rest of the request's sampling; a constrained request also stops when its grammar ends.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Prompt logprobs (echo/logprobs, ``lang.select``): -1 asks for none; otherwise the logprob of
    # every prompt token at index >= max(1, logprob_start_len) comes back with the first token.
    # A start past a shared prefix lets that prefix stay cacheable (only later positions scored).
    logprob_start_len: int = -1
    constraint: Constraint | None = None
    # Logits processing (engine.runner.penalties), applied where each token is sampled, in this
    # order: ``logit_bias`` (token id -> added to its logit), ``min_tokens`` (EOS and
    # ``stop_token_ids`` masked until that many tokens were generated), ``repetition_penalty``
    # (vLLM: over prompt + output, positive logits divided, negative multiplied; 1 is off), then
    # ``frequency_penalty`` x count and ``presence_penalty`` x seen over the output (OpenAI).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    # Alternatives per token (0-20) returned with each sampled token, and with each scored prompt
    # token: the most likely ids of the raw distribution (log-softmax before any processing).
    top_logprobs: int = 0
    # A reasoning model's think block (None: none, or nothing for the engine to enforce):
    # ``constraint`` applies after it, and it ends by force at its budget (engine.grammar.think).
    reasoning: ReasoningParams | None = None

    @property
    def needs_grammar(self) -> bool:
        """Whether the request's tokens go through a grammar (a constraint, or a think block the
        engine enforces): its worker prepares one before scheduling it."""
        return self.constraint is not None or self.reasoning is not None

    # Scheduling priority (vLLM's semantics): lower values are admitted first and preempted
    # last when KV pages run out (engine.sched.scheduler); equal values in arrival order.
    priority: int = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.logprob_start_len >= 0

    @property
    def has_penalties(self) -> bool:
        """Whether any logits processing other than ``min_tokens`` is asked for."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


class LoraRef(msgspec.Struct, frozen=True):
    """The LoRA adapter a request runs under: ``name`` (the ``model`` the client sent) and
    ``path``, its PEFT folder, from which a worker that has not loaded it (restarted, joined
    later) loads it before the request runs."""

    name: str
    path: str
