"""Chat messages (and tools) -> prompt text, through the model's chat template or ``--chat-template``.

:class:`ChatRenderer` decides once, at start-up, whether the template renders ``tools`` (it
renders a probe function into the prompt) and which tool-call format the model writes
(``--tool-call-parser``, or ``auto``: see :meth:`ChatRenderer._pick_format`). Templates that
ignore tools get the built-in tool prompt and their tool history rewritten into plain messages
(``server.tools.prompt``).

A system message we add (the built-in tool prompt, a ``response_format`` description) keeps
the template's own default system prompt in front of it (:attr:`ChatRenderer.default_system`):
a template such as SmolLM2's or Qwen2.5's writes one only when the conversation has no system
message, and Qwen2.5's own tool rendering keeps it too.
"""

from __future__ import annotations

import logging
from typing import Any

from splitserve.config.registry import REASONING_PARSER, TOOL_CALL_PARSER
from splitserve.server.reasoning.budget import NO_BUDGET
from splitserve.server.reasoning.formats import ReasoningFormat, detect_reasoning_format
from splitserve.server.reasoning.request import ReasoningSetup
from splitserve.server.template_vars import template_variables
from splitserve.server.tools.formats import BUILTIN_FORMAT, ToolCallFormat, detect_format
from splitserve.server.tools.prompt import builtin_messages

logger = logging.getLogger(__name__)

AUTO_PARSER = "auto"
NO_PARSER = "none"
# Names ``apply_chat_template`` sets or takes itself: ``chat_template_kwargs`` may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "conversation",
    "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now",
})
_PROBE_NAME = "splitserve_probe_function"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object"}}}]
_PROBE_SYSTEM = "splitserve_probe_system"


class ChatRenderer:
    """Renders one request's conversation as the model's prompt text.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        template: a Jinja chat template that replaces the tokenizer's (``--chat-template``).
        tool_call_parser: a ``config.registry.TOOL_CALL_PARSER`` name or ``"auto"``.
        family_format: the ``tool_call_format`` that ``engine.model.registry`` gives the
            model's architecture (a ``TOOL_CALL_PARSER`` name), or None where it gives none;
            ``auto`` reads it (:meth:`_pick_format`).
        reasoning_parser: a ``config.registry.REASONING_PARSER`` name, ``"none"``, or
            ``"auto"`` (the think block the template's text names; none without one).
        reasoning_budget: the thinking budget of requests that ask none (-1: none).

    Raises:
        ValueError: an unknown ``tool_call_parser``, ``family_format`` or ``reasoning_parser``.
    """

    def __init__(self, tokenizer: Any, template: str | None = None,
                 tool_call_parser: str = AUTO_PARSER, family_format: str | None = None,
                 reasoning_parser: str = AUTO_PARSER,
                 reasoning_budget: int = NO_BUDGET) -> None:
        if tool_call_parser != AUTO_PARSER:
            TOOL_CALL_PARSER.check(tool_call_parser)
        if family_format is not None:
            TOOL_CALL_PARSER.check(family_format)
        if reasoning_parser not in (AUTO_PARSER, NO_PARSER):
            REASONING_PARSER.check(reasoning_parser)
        self.tokenizer = tokenizer
        self.template: str | None = template or getattr(tokenizer, "chat_template", None)
        self.variables = template_variables(self.template)
        self.renders_tools = self._renders_tools()
        self.default_system = self._default_system()
        self.tool_format = self._pick_format(tool_call_parser, family_format)
        self.begin_token = special_token_id(tokenizer, self.tool_format.begin)
        # The format's markers that are special tokens (marker -> id): the grammar writes them
        # as tokens, and the answer's text must keep them for the parser.
        self.special_markers = {
            marker: token for marker in self.tool_format.markers
            if (token := special_token_id(tokenizer, marker)) is not None}
        fmt = self._pick_reasoning(reasoning_parser)
        self.reasoning = None if fmt is None else ReasoningSetup(fmt, tokenizer, reasoning_budget)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (``server.tools.prompt.hf_messages`` shape) with
        ``tools`` (OpenAI ``tools[]`` entries, or None), ending with the assistant's turn.
        ``template_kwargs``: more variables for the template (``chat_template_kwargs``, checked
        by :meth:`check_template_kwargs`).

        Raises:
            Exception: whatever the template raises for a conversation it refuses (jinja's
                ``TemplateError`` from ``raise_exception``, ...).
        """
        if not self.renders_tools:
            messages = builtin_messages(messages, self.tool_format, tools, self.default_system)
            tools = None
        return self._apply(messages, tools, template_kwargs)

    def check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Refuse a ``chat_template_kwargs`` name the template does not read (it would change
        nothing) or one the server sets itself.

        Raises:
            ValueError: naming the first such key (``chat_template_kwargs.enable_thinking:
                ...``).
        """
        for name in kwargs:
            where = f"chat_template_kwargs.{name}"
            if name in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"{where}: set by the server, not by a request")
            if self.variables is not None and name not in self.variables:
                known = sorted(self.variables - RESERVED_TEMPLATE_KWARGS)
                raise ValueError(
                    f"{where}: the chat template has no variable {name!r}, so it would change "
                    f"nothing (the template reads: {', '.join(known) or 'none'})")

    def _apply(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The template's text for ``messages`` (and ``tools``), ending with the assistant's
        turn; raises whatever the template raises."""
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=self.template,
            **kwargs)

    def _pick_reasoning(self, parser: str) -> ReasoningFormat | None:
        """The named format, none, or for ``auto`` the one the template's text names."""
        if parser == NO_PARSER:
            return None
        if parser != AUTO_PARSER:
            return REASONING_PARSER.load(parser)
        found = detect_reasoning_format(self.template)
        if found is not None:
            logger.info("the chat template has a think block: reasoning parser %s", found.name)
        return found

    def _renders_tools(self) -> bool:
        """Whether the template writes a tool it is given into the prompt."""
        probe = [{"role": "user", "content": "hi"}]
        try:
            text = self._apply(probe, _PROBE_TOOLS)
        except Exception as exc:  # noqa: BLE001 - a template that cannot take tools ignores them
            logger.info("chat template refused a tool (%s): using the built-in tool prompt", exc)
            return False
        return _PROBE_NAME in text

    def _default_system(self) -> str:
        """The system prompt the template writes when a conversation has none, or ``""``.

        Found by rendering one user message without and with a probe system message: where
        the two agree around the probe, what stands in its place without it is the default
        (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."). A template that puts a
        system message elsewhere (Mistral's, into the first user turn) or refuses one gives
        ``""``."""
        user = [{"role": "user", "content": "hi"}]
        try:
            plain = self._apply(user)
            probed = self._apply([{"role": "system", "content": _PROBE_SYSTEM}, *user])
        except Exception:  # noqa: BLE001 - a template without a system role has no default
            return ""
        at = probed.find(_PROBE_SYSTEM)
        if at < 0:
            return ""
        head, tail = probed[:at], probed[at + len(_PROBE_SYSTEM):]
        if (len(plain) < len(head) + len(tail) or not plain.startswith(head)
                or not plain.endswith(tail)):
            return ""
        return plain[len(head):len(plain) - len(tail)]

    def _pick_format(self, parser: str, family_format: str | None) -> ToolCallFormat:
        """The named parser, or for ``auto``, in order: the built-in prompt's format when the
        template ignores tools (the built-in prompt then says which format to write); the
        format the template's text names; the format of the model's family; the built-in one.

        The template's text comes before the family because a checkpoint's template is what
        it was trained with, and fine-tunes change it within one architecture (Hermes 3 is a
        ``LlamaForCausalLM`` writing ``<tool_call>`` blocks); the family decides when the
        template renders tools but names no format."""
        if parser != AUTO_PARSER:
            return TOOL_CALL_PARSER.load(parser)
        if not self.renders_tools:
            return BUILTIN_FORMAT
        found = detect_format(self.template)
        if found is not None:
            if family_format is not None and found.name != family_format:
                logger.info("the chat template names tool-call format %s, the model's family %s: "
                            "parsing %s", found.name, family_format, found.name)
            return found
        if family_format is not None:
            logger.info("the chat template names no tool-call format: parsing the model "
                        "family's, %s", family_format)
            return TOOL_CALL_PARSER.load(family_format)
        logger.warning("the chat template renders tools in a format none of the tool-call "
                       "parsers names; parsing %s (set --tool-call-parser)", BUILTIN_FORMAT.name)
        return BUILTIN_FORMAT


def special_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` where it is one special token (which no grammar spells as text), or
    None where it is ordinary text (or empty)."""
    if not text:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1 or ids[0] not in set(tokenizer.all_special_ids):
        added = getattr(tokenizer, "added_tokens_decoder", {}).get(ids[0]) if ids else None
        if len(ids) != 1 or added is None or not getattr(added, "special", False):
            return None
    return ids[0]
