"""splitserve.lang: multi-step prompt programs (SGLang-style frontend language).

    from splitserve import lang

    @lang.function
    def qa(s, question):
        s += lang.user(question)
        s += lang.assistant(lang.gen("answer", max_tokens=64))

    lang.set_default_backend(lang.Endpoint("http://127.0.0.1:8000"))
    print(qa.run(question="What is 2 + 2?")["answer"])

See ``docs/dsl.md``.
"""

from splitserve.lang.anthropic_compatible import AnthropicCompatible
from splitserve.lang.backend import BaseBackend, ChatPrompt, GenOutput, SelectOutput, TextPrompt
from splitserve.lang.endpoint import Capabilities, Endpoint
from splitserve.lang.errors import BackendError, ProgramError
from splitserve.lang.ir import (
    ConstantText,
    Fork,
    Gen,
    Join,
    Node,
    RoleBegin,
    RoleEnd,
    Select,
)
from splitserve.lang.openai_compatible import OpenAICompatible
from splitserve.lang.primitives import assistant, gen, select, system, tool, user
from splitserve.lang.program import Program, function, get_default_backend, set_default_backend
from splitserve.lang.state import ForkGroup, ProgramState
from splitserve.lang.tool_calls import ToolCall
from splitserve.lang.tool_spec import tool_spec
from splitserve.lang.tracer import Trace

__all__ = [
    "AnthropicCompatible", "BackendError", "BaseBackend", "Capabilities", "ChatPrompt", "ConstantText", "Endpoint",
    "Fork", "ForkGroup", "Gen", "GenOutput", "Join", "Node", "OpenAICompatible", "Program",
    "ProgramError", "ProgramState", "RoleBegin", "RoleEnd", "Select", "SelectOutput",
    "TextPrompt", "ToolCall", "Trace", "assistant", "function", "gen", "get_default_backend",
    "select", "set_default_backend", "system", "tool", "tool_spec", "user",
]
