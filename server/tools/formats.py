"""How a model writes a tool call: the envelope around each call's name and arguments.

One :class:`ToolCallFormat` per family of chat templates; the parser (``server.tools.extract``),
the grammar (``server.tools.grammar``) and the built-in tool prompt (``server.tools.prompt``) all
read the same description, so what we ask for, what we enforce and what we parse agree.

- ``hermes``: ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>``, one block per call
  (NousResearch Hermes, Qwen2.5; the built-in tool prompt asks for it too). Qwen2.5-Coder writes
  the same object without the tags, so the bare object is a call as well.
- ``llama3_json``: ``{"name": N, "parameters": A}``, calls separated by ``;`` (Llama 3.1/3.2's
  JSON tool calling).
- ``mistral``: ``[TOOL_CALLS][{"name": N, "arguments": A}, ...]`` (Mistral v0.3 templates; the
  marker is a special token there), call ids of 9 letters and digits, as its template demands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One envelope family.

    Attributes:
        name: the ``--tool-call-parser`` name.
        begin: marker written before a call (``in_list``: before the list of calls); "" none.
        end: marker written after a call; "" none.
        args_key: the key of the arguments object (``arguments`` or ``parameters``).
        in_list: the calls are one JSON list after ``begin`` (Mistral).
        bare_calls: a call object with no markers around it is a call too.
        separator: written between two calls (besides whitespace).
        id_length: 9 for Mistral's ids; 0 for OpenAI-style ``call_...`` ids.
        template_markers: text whose presence in a chat template identifies the family.
    """

    name: str
    begin: str
    end: str
    args_key: str
    in_list: bool = False
    bare_calls: bool = False
    separator: str = "\n"
    id_length: int = 0
    template_markers: tuple[str, ...] = ()

    @property
    def object_prefix(self) -> str:
        """What every call object starts with, up to the name's opening quote."""
        return '{"name": "'

    def header(self, name: str) -> str:
        """A call object up to its arguments: ``{"name": "N", "arguments": ``."""
        return f'{{"name": {json.dumps(name)}, "{self.args_key}": '

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """The text a model of this family writes for ``calls`` (name, arguments JSON text)."""
        objects = [self.header(name) + arguments + "}" for name, arguments in calls]
        if self.in_list:
            return f"{self.begin}[{', '.join(objects)}]"
        if self.begin:
            objects = [f"{self.begin}\n{o}\n{self.end}" for o in objects]
        return self.separator.join(objects)


HERMES = ToolCallFormat(
    "hermes", begin="<tool_call>", end="</tool_call>", args_key="arguments", bare_calls=True,
    template_markers=("<tool_call>",),
)
LLAMA3_JSON = ToolCallFormat(
    "llama3_json", begin="", end="", args_key="parameters", separator="; ",
    template_markers=("<|python_tag|>", '"parameters"'),
)
MISTRAL = ToolCallFormat(
    "mistral", begin="[TOOL_CALLS]", end="", args_key="arguments", in_list=True, id_length=9,
    template_markers=("[TOOL_CALLS]",),
)
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, MISTRAL, LLAMA3_JSON)}
BUILTIN_FORMAT = HERMES  # what the built-in tool prompt asks a model to write


def detect_format(template: str | None) -> ToolCallFormat | None:
    """The family a chat template's text names (Mistral before Llama: both mention
    ``parameters``), or None when it names none."""
    if not template:
        return None
    for fmt in FORMATS.values():
        if any(marker in template for marker in fmt.template_markers):
            return fmt
    return None
