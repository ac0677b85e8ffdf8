"""How a model writes a tool call: the envelope around each call's name and arguments.

One :class:`ToolCallFormat` per family of chat templates; the parser (``server.tools.parsers``),
the grammar (``server.tools.grammar``) and the built-in tool prompt (``server.tools.prompt``) all
read the same description, so what we ask for, what we enforce and what we parse agree.

JSON families (``family = "json"``, parsed by ``server.tools.extract``):

- ``hermes``: ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>``, one block per call
  (NousResearch Hermes, Qwen2.5, Qwen3; the built-in tool prompt asks for it too).
  Qwen2.5-Coder writes the same object without the tags, so the bare object is a call as well.
- ``llama3_json``: ``{"name": N, "parameters": A}``, calls separated by ``;`` (Llama 3.1/3.2's
  JSON tool calling).
- ``mistral``: ``[TOOL_CALLS][{"name": N, "arguments": A}, ...]`` (Mistral v0.3 templates; the
  marker is a special token there), call ids of 9 letters and digits, as its template demands.

The others:

- ``qwen3_coder`` (``server.tools.xml_calls``): ``<tool_call>\\n<function=N>\\n<parameter=K>\\n
  V\\n</parameter>\\n...</function>\\n</tool_call>``, each argument an XML-ish element whose
  value is raw text for a string and JSON otherwise (Qwen3-Coder, Qwen3.5).
- ``pythonic`` (``server.tools.pythonic_calls``): ``[f(a=1), g(b="x")]``, keyword arguments as
  Python literals (Llama 3.2's pythonic template, Llama 4).
- ``deepseek_v3`` (``server.tools.deepseek_calls``): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>
  function<｜tool▁sep｜>N\\n```json\\nA\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``, its
  markers special tokens in DeepSeek's tokenizer (DeepSeek-V3, R1-0528).

References: the models' own chat templates, and vLLM's parsers of the same names
(``vllm/entrypoints/openai/tool_parsers/``: ``qwen3coder``, ``pythonic``, ``deepseekv3``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One envelope family.

    Attributes:
        name: the ``--tool-call-parser`` name.
        begin: marker written before a call (``in_list``: before the list of calls); "" none.
        end: marker written after a call (``in_list``: after the list); "" none.
        args_key: the key of the arguments object (``arguments`` or ``parameters``).
        in_list: the calls are one list after ``begin`` (Mistral).
        bare_calls: a call object with no markers around it is a call too.
        separator: written between two calls (besides whitespace).
        id_length: 9 for Mistral's ids; 0 for OpenAI-style ``call_...`` ids.
        template_markers: text whose presence in a chat template identifies the family.
        family: which parser and grammar builder read it: ``json``, ``qwen3_xml``,
            ``pythonic`` or ``deepseek``.
    """

    name: str
    begin: str
    end: str
    args_key: str = "arguments"
    in_list: bool = False
    bare_calls: bool = False
    separator: str = "\n"
    id_length: int = 0
    template_markers: tuple[str, ...] = ()
    family: str = "json"

    @property
    def object_prefix(self) -> str:
        """What every call object starts with, up to the name's opening quote."""
        return '{"name": "'

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker of the envelope (each may be a special token of a tokenizer, which the
        answer's text must then keep for the parser)."""
        return tuple(m for m in (self.begin, self.end) if m)

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


@dataclass(frozen=True, slots=True)
class XmlCallFormat(ToolCallFormat):
    """Qwen3-Coder's XML calls: ``<tool_call>`` around ``<function=N>`` with one
    ``<parameter=K>`` element per argument."""

    function_prefix: str = "<function="
    parameter_prefix: str = "<parameter="

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        out = []
        for name, arguments in calls:
            params = "".join(
                f"{self.parameter_prefix}{key}>\n{_xml_value(value)}\n</parameter>\n"
                for key, value in _as_object(arguments).items())
            out.append(f"{self.begin}\n{self.function_prefix}{name}>\n{params}</function>\n"
                       f"{self.end}")
        return self.separator.join(out)


@dataclass(frozen=True, slots=True)
class PythonicFormat(ToolCallFormat):
    """Calls as one Python list of function calls with keyword arguments."""

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        rendered = []
        for name, arguments in calls:
            args = ", ".join(f"{key}={python_literal(value)}"
                             for key, value in _as_object(arguments).items())
            rendered.append(f"{name}({args})")
        return f"[{', '.join(rendered)}]"


@dataclass(frozen=True, slots=True)
class DeepSeekFormat(ToolCallFormat):
    """DeepSeek-V3's calls: one block of calls, each a ``function`` name and fenced JSON."""

    call_begin: str = "<｜tool▁call▁begin｜>"
    call_end: str = "<｜tool▁call▁end｜>"
    sep: str = "<｜tool▁sep｜>"

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.begin, self.end, self.call_begin, self.call_end, self.sep)

    def call_head(self, name: str) -> str:
        """One call up to its arguments: ``<call_begin>function<sep>N\\n```json\\n``."""
        return f"{self.call_begin}function{self.sep}{name}\n```json\n"

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        body = self.separator.join(f"{self.call_head(name)}{arguments}\n```{self.call_end}"
                                   for name, arguments in calls)
        return f"{self.begin}{body}{self.end}"


def python_literal(value: Any) -> str:
    """A JSON value as the Python literal a pythonic call writes (``True``, ``None``, strings
    double-quoted with JSON's escapes, which Python reads the same)."""
    if value is True:
        return "True"
    if value is False:
        return "False"
    if value is None:
        return "None"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {python_literal(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def _as_object(arguments: str) -> dict[str, Any]:
    """Arguments JSON text as a dict (a placeholder such as ``ARGUMENTS``: empty)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _xml_value(value: Any) -> str:
    """A parameter's value as Qwen3-Coder's template writes it: a string raw, else JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


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
QWEN3_CODER = XmlCallFormat(
    "qwen3_coder", begin="<tool_call>", end="</tool_call>", family="qwen3_xml",
    template_markers=("<function=", "<parameter="),
)
PYTHONIC = PythonicFormat(
    "pythonic", begin="[", end="]", separator=", ", family="pythonic",
    template_markers=("[func_name1(", "func_name1(params_name1="),
)
DEEPSEEK_V3 = DeepSeekFormat(
    "deepseek_v3", begin="<｜tool▁calls▁begin｜>", end="<｜tool▁calls▁end｜>", family="deepseek",
    template_markers=("<｜tool▁calls▁begin｜>",),
)
# Detection order (detect_format): a template names the markers of its own family, and some
# name another's too (Qwen3-Coder's writes <tool_call>, Mistral's and pythonic ones mention
# "parameters"), so the more specific families come first.
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    DEEPSEEK_V3, QWEN3_CODER, HERMES, MISTRAL, PYTHONIC, LLAMA3_JSON)}
BUILTIN_FORMAT = HERMES  # what the built-in tool prompt asks a model to write


def detect_format(template: str | None) -> ToolCallFormat | None:
    """The family a chat template's text names, or None when it names none."""
    if not template:
        return None
    for fmt in FORMATS.values():
        if any(marker in template for marker in fmt.template_markers):
            return fmt
    return None
