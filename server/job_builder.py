"""Request -> job: the checks that need the served model, the prompt's token ids (the chat
template for chat), and the request's ``SamplingParams``.

``server.protocol`` has already checked each field on its own; what is checked here needs the
tokenizer or the context length. Every refusal is an :class:`APIError` (HTTP 400) naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from splitserve.ipc.messages import Constraint, LoraRef, ReasoningParams, SamplingParams
from splitserve.observe.timing import RequestTiming
from splitserve.server.chat_template import ChatRenderer
from splitserve.server.constraints import constraint_from_request
from splitserve.server.errors import APIError
from splitserve.server.format_prompt import with_format_description
from splitserve.server.formatter import ResponseFormatter, Usage
from splitserve.server.job import Job
from splitserve.server.models import MODEL_ALIAS, ServedModels
from splitserve.server.prompt_bound import prompt_bound
from splitserve.server.protocol import BaseGenerateRequest, ChatCompletionRequest, CompletionRequest
from splitserve.server.reasoning.budget import thinking_budget
from splitserve.server.reasoning.request import ReasoningRequest
from splitserve.server.tools.prompt import hf_messages
from splitserve.server.tools.request import ToolRequest, tool_request

__all__ = ["MODEL_ALIAS", "JobBuilder"]


class JobBuilder:
    """Builds the :class:`Job` of each request to the model ``model_name``.

    Args:
        tokenizer: the model's Hugging Face tokenizer (with a chat template for chat).
        model_name: the base model's name (:data:`MODEL_ALIAS` is accepted too).
        context_len: prompt + generated tokens may not exceed this (tokens).
        eos_token_ids: ids that end generation unless the request sets ``ignore_eos``.
        models: the names ``model`` may take, LoRA adapters included (``server.models``;
            default: the base model's only). Every job's ``model`` resolves there
            (:meth:`resolve_model`), whichever endpoint built it.
    """

    def __init__(
        self, tokenizer: Any, model_name: str, context_len: int, eos_token_ids: list[int],
        chat: ChatRenderer | None = None, models: ServedModels | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat = chat or ChatRenderer(tokenizer)
        self.model_name = model_name
        self.context_len = context_len
        self.eos_token_ids = eos_token_ids
        self.models = models or ServedModels(model_name)
        self.bound = prompt_bound(tokenizer)

    def serves(self, model: str) -> bool:
        """Whether ``model`` names the base model or a LoRA adapter served on it."""
        return self.models.serves(model)

    def resolve_model(self, model: str) -> LoraRef | None:
        """The LoRA adapter ``model`` names (None: the base model).

        Raises:
            APIError: 404 naming a model this server does not serve.
        """
        return self.models.resolve(model)

    def completion_jobs(self, req: CompletionRequest, request_id: str | None = None,
                        timing: RequestTiming | None = None) -> list[Job]:
        """The jobs of a ``/v1/completions`` request: one per prompt (``server.choices`` forks
        each into its ``n`` choices), all under one response id (``request_id``: the client's
        ``X-Request-Id``, which the rid carries: :func:`new_rid`).

        Raises:
            APIError: a model not served (404), ``best_of`` > 1, an echo/logprobs combination not served
                (:func:`check_echo`), several prompts with ``stream``, a sampling field out of
                range (:meth:`_check_sampling`), a token id outside the vocabulary, or no room
                in the context.
        """
        self._check_model(req)
        check_echo(req)
        prompts = req.prompts
        if len(prompts) > 1 and req.stream:
            raise APIError("prompt: a list of several prompts is not supported with stream",
                           param="prompt")
        rid = new_rid(False, request_id)
        constraint = constraint_from_request(req)
        jobs = []
        for i, prompt in enumerate(prompts):
            ids = self._completion_ids(req, prompt, timing)
            reasoning = self._reasoning(
                req, prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt),
                constraint is not None)
            job = self._make_job(req, ids, is_chat=False,
                                 rid=rid if len(prompts) == 1 else f"{rid}-{i}", response_id=rid,
                                 constraint=constraint, reasoning=reasoning)
            if req.echo:
                job.echo_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
            job.logprobs = "completion" if req.logprobs is not None else None
            job.discard_output = req.max_tokens == 0
            jobs.append(job)
        return jobs

    def chat_job(self, req: ChatCompletionRequest, request_id: str | None = None,
                 timing: RequestTiming | None = None, continuation: str = "") -> Job:
        """The job of a ``/v1/chat/completions`` request (``request_id`` as in
        :meth:`completion_jobs`; ``timing``: where the template's and the tokenizer's times
        are recorded, ``RequestTiming.prepare``). ``continuation``: text the assistant's answer
        starts with (Anthropic's prefill): the prompt ends with it, after the generation
        prompt, and the answer continues it.

        Raises:
            APIError: a model not served (404), ``best_of`` > 1, ``top_logprobs`` without ``logprobs``, a
                sampling field out of range, a conversation the chat template refuses, tool
                fields that do not fit together (``server.tools.request``), or no room in the
                context.
        """
        self._check_model(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        tools = self._tools(req)
        rid = new_rid(True, request_id)
        start = time.time()
        text = self._chat_text(req, tools.tools) + continuation
        self._refuse_far_over_context(text, "messages")
        rendered = time.time()
        # The template already wrote BOS and the role markers; don't add them twice.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if timing is not None:
            timing.prepare += [("template", start, rendered), ("tokenize", rendered, time.time())]
        constraint = tools.constraint or constraint_from_request(req)
        reasoning = self._reasoning(req, text, constraint is not None)
        job = self._make_job(req, ids, is_chat=True, rid=rid, response_id=rid,
                             constraint=constraint, reasoning=reasoning)
        job.tool_format, job.tool_functions = tools.format, tools.functions
        job.splits_reasoning = True
        if tools.format is not None:
            job.keep_tokens = {token: marker
                               for marker, token in self.chat.special_markers.items()}
        job.logprobs = "chat" if req.logprobs else None
        return job

    def _tools(self, req: ChatCompletionRequest) -> ToolRequest:
        return tool_request(req, self.chat.tool_format, self.chat.begin_token,
                            self.chat.special_markers)

    def _reasoning(self, req: BaseGenerateRequest, prompt: str,
                   constrained: bool) -> ReasoningRequest | None:
        """The request's reasoning (None where the server has no reasoning parser).

        Raises:
            APIError: a thinking budget asked of a server without a reasoning parser, or both
                ``reasoning_effort`` and ``thinking_token_budget`` (400 naming the field).
        """
        setup = self.chat.reasoning
        effort = req.reasoning_effort if isinstance(req, ChatCompletionRequest) else None
        tokens = req.thinking_token_budget
        if setup is None:
            for param, value in (("reasoning_effort", effort), ("thinking_token_budget", tokens)):
                if value is not None:
                    raise APIError(
                        f"{param}: the served model has no reasoning parser (its chat template "
                        "has no think block, or the server runs with --reasoning-parser none)",
                        param=param)
            return None
        try:
            budget = thinking_budget(effort, tokens, setup.default_budget)
        except ValueError as exc:
            raise APIError(str(exc), param="thinking_token_budget") from None
        return setup.for_prompt(prompt, budget, constrained)

    def prompt_ids(self, req: BaseGenerateRequest, continuation: str = "") -> list[int]:
        """The prompt's token ids exactly as a generation request would send them
        (``POST /tokenize``; a chat request's tools rendered as for generation, and its
        ``continuation`` as :meth:`chat_job` takes it; a completion request's first prompt).

        Raises:
            APIError: as :meth:`chat_job` / :meth:`completion_jobs` for the prompt.
        """
        if isinstance(req, ChatCompletionRequest):
            text = self._chat_text(req, self._tools(req).tools) + continuation
            self._refuse_far_over_context(text, "messages")
            return self.tokenizer.encode(text, add_special_tokens=False)
        assert isinstance(req, CompletionRequest)
        return self._completion_ids(req, req.prompts[0])

    def _check_model(self, req: BaseGenerateRequest) -> None:
        self.resolve_model(req.model)
        # ``n`` (1..server.fields.MAX_N, the field table's range) forks each prompt's job in
        # server.choices; best_of is refused there too (vLLM removed it).
        if req.best_of not in (None, 1):
            raise APIError("best_of: only best_of=1 is supported", param="best_of")

    def _completion_ids(self, req: CompletionRequest, prompt: str | list[int],
                        timing: RequestTiming | None = None) -> list[int]:
        if isinstance(prompt, str):
            start = time.time()
            self._refuse_far_over_context(prompt, "prompt")
            # By default a raw prompt gets BOS where the model expects one.
            ids = self.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
            if timing is not None:
                timing.prepare.append(("tokenize", start, time.time()))
            return ids
        bad = self._first_outside_vocab(prompt)
        if bad is not None:
            raise APIError(f"prompt: token id {bad} is outside the vocabulary", param="prompt")
        return list(prompt)

    def _first_outside_vocab(self, ids: Any) -> int | None:
        vocab_size = len(self.tokenizer)
        return next((t for t in ids if not 0 <= t < vocab_size), None)

    def _check_sampling(self, req: BaseGenerateRequest, max_tokens: int | None) -> None:
        """The sampling fields' checks that need the vocabulary or ``max_tokens``.

        Raises:
            APIError: a ``logit_bias`` or ``stop_token_ids`` id outside the vocabulary, or
                ``min_tokens`` above the ``max_tokens`` in effect.
        """
        for param, ids in (("logit_bias", req.logit_bias), ("stop_token_ids", req.stop_token_ids)):
            bad = self._first_outside_vocab(ids or ())
            if bad is not None:
                raise APIError(f"{param}: token id {bad} is outside the vocabulary", param=param)
        if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
            raise APIError(f"min_tokens: {req.min_tokens} exceeds max_tokens ({max_tokens})",
                           param="min_tokens")

    def _chat_text(self, req: ChatCompletionRequest, tools: list[dict] | None) -> str:
        """The rendered prompt of a chat request (its template's text)."""
        kwargs = req.chat_template_kwargs or {}
        try:
            self.chat.check_template_kwargs(kwargs)
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(":")[0]) from None
        try:
            messages = hf_messages(req.messages)
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(":")[0]) from None
        fmt = req.response_format
        # Only a json_schema format's: under "text" or "json_object" a json_schema is no part
        # of OpenAI's format (ignored, as its schema is), so its description is not shown.
        if (fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None
                and fmt.json_schema.description):
            messages = with_format_description(
                messages, fmt.json_schema.name, fmt.json_schema.description,
                self.chat.default_system)
        try:
            return self.chat.render(messages, tools, kwargs)
        except Exception as exc:  # jinja raises on conversations the template refuses
            raise APIError(f"messages: chat template failed: {exc}", param="messages") from exc

    def _refuse_far_over_context(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text that has at least the context's tokens by its
        length in bytes alone (``server.prompt_bound``: no valid prompt is refused here).

        Raises:
            APIError: 400 naming ``param``.
        """
        num_bytes = self.bound.counted_bytes(text.encode("utf-8", errors="surrogatepass"))
        at_least = self.bound.min_tokens(num_bytes)
        if at_least >= self.context_len:
            raise APIError(
                f"{param}: the prompt has at least {at_least} tokens ({num_bytes} bytes; no "
                f"token of this model covers more than {self.bound.max_bytes_per_token:g}); the "
                f"context length is {self.context_len}, leaving no room to generate",
                param=param)

    def _make_job(
        self, req: BaseGenerateRequest, input_ids: list[int], is_chat: bool, rid: str,
        response_id: str, constraint: Constraint | None = None,
        reasoning: ReasoningRequest | None = None,
    ) -> Job:
        """One prompt's job: ``rid`` names it on the workers, ``response_id`` is the answer's
        ``id`` (the same unless the request has several prompts)."""
        prompt_param = "messages" if is_chat else "prompt"
        if not input_ids:
            raise APIError(f"{prompt_param}: the prompt is empty", param=prompt_param)
        room = self.context_len - len(input_ids)
        if room <= 0:
            raise APIError(
                f"{prompt_param}: the prompt has {len(input_ids)} tokens; the context length is "
                f"{self.context_len}, leaving no room to generate",
                param=prompt_param,
            )
        max_param, max_tokens = "max_tokens", req.max_tokens
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            max_param, max_tokens = "max_completion_tokens", req.max_completion_tokens
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                f"{max_param}: {max_tokens} new tokens + {len(input_ids)} prompt tokens exceed "
                f"the context length {self.context_len}; at most {room} allowed",
                param=max_param,
            )
        self._check_sampling(req, max_tokens)
        fmt = ResponseFormatter(response_id, int(time.time()), req.model, is_chat,
                                req.include_usage, req.continuous_usage)
        sampling = self._sampling(req, room, max_tokens, constraint,
                                  None if reasoning is None else reasoning.params)
        job = Job(rid, input_ids, sampling, req.stop or [], fmt, Usage(len(input_ids)),
                  req.return_token_ids)
        job.lora = self.resolve_model(req.model)
        job.reasoning = reasoning
        return job

    def _sampling(
        self, req: BaseGenerateRequest, room: int, max_tokens: int | None,
        constraint: Constraint | None = None, reasoning: ReasoningParams | None = None,
    ) -> SamplingParams:
        scores_prompt = isinstance(req, CompletionRequest) and req.wants_prompt_logprobs
        if isinstance(req, CompletionRequest):
            top_logprobs = req.logprobs or 0
        else:
            top_logprobs = (req.top_logprobs or 0) if req.logprobs else 0
        eos = [] if req.ignore_eos else list(self.eos_token_ids)
        return SamplingParams(
            # max_tokens 0 (echo only): the engine always samples a first token; it is dropped.
            max_new_tokens=room if max_tokens is None else max(1, max_tokens),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            # The chat template's end marker may differ from config's EOS; send both. The
            # request's own stop ids end the output even with ignore_eos (vLLM's reading).
            stop_token_ids=eos + [t for t in req.stop_token_ids or () if t not in eos],
            ignore_eos=req.ignore_eos,
            logprob_start_len=(req.logprob_start_len or 0) if scores_prompt else -1,
            # The caller's: the tool-call grammar (server.tools), or the request's own
            # constraint fields (constraint_from_request), which tool_request refuses together.
            constraint=constraint,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=dict(req.logit_bias or {}),
            min_tokens=req.min_tokens or 0,
            top_logprobs=top_logprobs,
            reasoning=reasoning,
            priority=req.priority or 0,
        )


def new_rid(is_chat: bool, request_id: str | None = None) -> str:
    """A fresh request id: ``chatcmpl-<uuid>`` / ``cmpl-<uuid>``, or the client's
    ``X-Request-Id`` with 8 random hex digits after it. The suffix keeps a reused client id (a
    retry, a fixed id per conversation) from meeting a previous request's state on the workers,
    which track requests by rid; the client's id still starts it, so logs can be searched by it.
    """
    if request_id is not None:
        return f"{request_id}-{uuid.uuid4().hex[:8]}"
    return f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"


def check_echo(req: CompletionRequest) -> None:
    """The combinations of echo/logprobs this server does not serve, as 400s.

    Raises:
        APIError: ``max_tokens`` 0 without ``echo``, or ``stream`` with ``echo``.
    """
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            "max_tokens: 0 is only allowed with echo (to score the prompt)", param="max_tokens"
        )
    if req.stream and req.echo:
        raise APIError("stream: echo is not supported with stream", param="stream")
