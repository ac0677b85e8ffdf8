"""``Endpoint``: a splitserve server, with its native features.

- Roles render client-side through the model's own chat template (``GET /chat_template``) and go
  to ``/v1/completions`` with ``add_special_tokens: false``, so a program can generate anywhere
  inside a message and ``select`` can score choices after a partial assistant message.
- Constraints: ``regex``, ``choice`` and ``ebnf`` (``gen(grammar=...)``) extension fields and
  ``response_format`` json_schema.
- Tools: ``gen(tools=...)`` goes to ``/v1/chat/completions`` (the server renders the tools and
  parses the calls), and so does every later step of a program whose history holds tool turns.
- ``select``: prompt-token logprobs via ``echo`` + ``logprobs`` + ``max_tokens: 0``, scoring only
  from just before the choice (``logprob_start_len``) so the prompt stays cacheable.

Which of these the server really enforces is probed once (:meth:`Endpoint.capabilities`): a
splitserve server ignores request fields it does not know, so a server built before constraints
landed would silently answer unconstrained. A step that needs a missing feature fails with a
:class:`BackendError` (``unsupported``) instead.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from splitserve.lang.backend import (
    ChatPrompt,
    GenOutput,
    Prompt,
    SamplingArgs,
    SelectOutput,
    TextPrompt,
    ToolsArgs,
)
from splitserve.lang.chat_template import ChatTemplate
from splitserve.lang.errors import BackendError
from splitserve.lang.grammar_field import probe_grammar_field, unsupported_grammar
from splitserve.lang.openai_compatible import OpenAIBackendBase, json_schema_format
from splitserve.radix_cache.token_prefix import common_prefix_len

_PROBE_REGEX = "zqqz"  # an output no unconstrained model produces from the probe prompt
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe", "parameters": {"type": "object", "properties": {},
                                    "additionalProperties": False}}}
_NO_SCORES = 10**9  # logprob_start_len past any prompt: tokens back, nothing scored


@dataclass(slots=True, frozen=True)
class Capabilities:
    """What a server was seen to do. ``constraints``: a regex-constrained probe matched.
    ``prompt_logprobs``: echo + logprobs scored prompt tokens. ``prefix_cache``: a repeated
    prompt reported ``cached_tokens > 0``. ``tools``: a chat request naming a function came
    back with ``tool_calls``. ``grammar``: a probe whose ``ebnf`` grammar allows one word came
    back as that word (``lang.grammar_field``)."""

    constraints: bool
    prompt_logprobs: bool
    prefix_cache: bool
    tools: bool
    grammar: bool


class Endpoint(OpenAIBackendBase):
    """A splitserve server at ``url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, url: str, model: str = "default", timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        super().__init__(self.url + "/v1", model, None, timeout_s)
        self._lock = threading.Lock()
        self._template: ChatTemplate | None | bool = False  # False: not fetched yet
        self._caps: Capabilities | None = None
        self._grammar_refusal: str | None = None  # why the ebnf probe failed

    # ---- discovery ----------------------------------------------------------------------------

    def chat_template(self) -> ChatTemplate | None:
        with self._lock:
            if self._template is False:
                r = self.http.get_url(self.url + "/chat_template")
                # An older server without the route: roles fall back to chat messages.
                info = r.json() if r.status_code == 200 else {}
                self._template = ChatTemplate.from_server_info(info)
            return self._template  # type: ignore[return-value]

    def capabilities(self) -> Capabilities:
        """Probe the server once (five tiny requests) and remember the answer."""
        with self._lock:
            if self._caps is None:
                self._grammar_refusal = probe_grammar_field(self.http, self.model, "ebnf",
                                                            chat=False)
                self._caps = Capabilities(
                    self._probe_constraints(), self._probe_logprobs(), self._probe_cache(),
                    self._probe_tools(), self._grammar_refusal is None,
                )
            return self._caps

    def _probe_tools(self) -> bool:
        body = {"model": self.model, "max_tokens": 48, "temperature": 0.0,
                "messages": [{"role": "user", "content": "Call the probe."}],
                "tools": [_PROBE_TOOL], "tool_choice": {"type": "function",
                                                         "function": {"name": "probe"}}}
        try:
            message = self.http.post("/chat/completions", body)["choices"][0]["message"]
        except BackendError as exc:
            if exc.status_code == 400:
                return False
            raise
        return bool(message.get("tool_calls"))

    def _probe_constraints(self) -> bool:
        body = {"model": self.model, "prompt": "0", "max_tokens": 8, "temperature": 0.0,
                "regex": _PROBE_REGEX}
        try:
            return self.http.post("/completions", body)["choices"][0]["text"] == _PROBE_REGEX
        except BackendError as exc:
            if exc.status_code == 400:
                return False
            raise

    def _probe_logprobs(self) -> bool:
        try:
            lp = self._score("a b c", 0)["logprobs"]
        except BackendError as exc:
            if exc.status_code == 400:
                return False
            raise
        return bool(lp) and any(x is not None for x in lp.get("token_logprobs") or [])

    def _probe_cache(self) -> bool:
        prompt = TextPrompt("splitserve prefix cache probe: " + "lorem ipsum " * 16)
        self.prefill(prompt)
        return self.prefill(prompt)["cached_tokens"] > 0

    # ---- steps --------------------------------------------------------------------------------

    def constraint_fields(self, constraint: tuple[str, Any] | None,
                          chat: bool = False) -> dict[str, Any]:
        if constraint is None:
            return {}
        if constraint[0] == "grammar":
            if not self.capabilities().grammar:
                raise unsupported_grammar(self.url, self._grammar_refusal or "")
            return {"ebnf": constraint[1]}
        if not self.capabilities().constraints:
            raise BackendError(
                f"the server at {self.url} does not enforce constraints (a regex probe came back "
                "unconstrained); it needs the structured-generation feature", unsupported=True)
        kind, value = constraint
        if kind == "regex":
            return {"regex": value}
        if kind == "choices":
            return {"choice": value}
        return {"response_format": json_schema_format(value)}

    def generate_tools(self, prompt: ChatPrompt, sampling: SamplingArgs,
                       tools: ToolsArgs) -> GenOutput:
        if not self.capabilities().tools:
            raise BackendError(
                f"the server at {self.url} does not return tool calls (a probe naming a function "
                "came back without tool_calls); it needs the tool-calling feature",
                unsupported=True)
        return super().generate_tools(prompt, sampling, tools)

    def _score(self, text: str, start: int, templated: bool = False) -> dict[str, Any]:
        """Echo ``text`` with its tokens' ids and logprobs from index ``start`` on."""
        body = {"model": self.model, "prompt": text, "max_tokens": 0, "echo": True,
                "logprobs": 0, "logprob_start_len": start, "return_token_ids": True,
                "add_special_tokens": not templated}
        return self.http.post("/completions", body)["choices"][0]

    def select(self, prompt: Prompt, choices: list[str]) -> SelectOutput:
        if not isinstance(prompt, TextPrompt):
            raise BackendError("select needs a text prompt: this one is chat messages (the "
                               "server has no chat template, or the program used tools)",
                               unsupported=True)
        if not self.capabilities().prompt_logprobs:
            raise BackendError(f"the server at {self.url} does not return prompt logprobs "
                               "(echo + logprobs), which select needs", unsupported=True)
        # The prompt alone: its token ids (and it warms the prefix cache for the choices).
        base_ids = self._score(prompt.text, _NO_SCORES, prompt.templated)["prompt_token_ids"]
        # A choice may merge with the prompt's last token(s); score from a little before.
        start = max(0, len(base_ids) - 2)
        with ThreadPoolExecutor(len(choices)) as pool:
            scored = list(pool.map(
                lambda c: self._choice_logprobs(prompt, c, base_ids, start), choices))
        sums = [sum(lps) for lps in scored]
        norm = [s / len(lps) if lps else float("-inf") for s, lps in zip(sums, scored)]
        best = max(range(len(choices)), key=lambda i: norm[i])
        return SelectOutput(best, norm, sums, [len(x) for x in scored])

    def _choice_logprobs(self, prompt: TextPrompt, choice: str, base_ids: list[int],
                         start: int) -> list[float]:
        """Logprobs of the tokens of prompt + choice after the tokens it shares with the prompt
        alone (so a token that spans the boundary counts as the choice's)."""
        out = self._score(prompt.text + choice, start, prompt.templated)
        ids, lps = out["prompt_token_ids"], out["logprobs"]["token_logprobs"][: len(out[
            "prompt_token_ids"])]
        k = common_prefix_len(base_ids, ids)
        if k < start:  # the boundary moved further back than expected: score from k
            out = self._score(prompt.text + choice, k, prompt.templated)
            lps = out["logprobs"]["token_logprobs"]
        # Index 0 has no logprob (nothing predicts it): only an empty prompt reaches it.
        return [lp for lp in lps[k : len(ids)] if lp is not None]
