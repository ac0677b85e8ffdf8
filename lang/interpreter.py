"""Runs one IR node on a :class:`ProgramState` (called from the state's worker thread)."""

from __future__ import annotations

from splitserve.lang.backend import GenOutput, SamplingArgs, ToolsArgs
from splitserve.lang.constraints import constraint_of, parse_output
from splitserve.lang.ir import ConstantText, Gen, Node, RoleBegin, RoleEnd, Select
from splitserve.lang.state import ProgramState, StepFailed


def execute(state: ProgramState, node: Node) -> None:
    """Apply ``node`` to ``state``.

    Raises:
        StepFailed, BackendError, ValueError: the step failed; the state records which step.
    """
    if isinstance(node, ConstantText):
        state.apply_text(node.text)
    elif isinstance(node, (RoleBegin, RoleEnd)):
        state.apply_role(node)
    elif isinstance(node, Gen):
        _gen(state, node)
    elif isinstance(node, Select):
        _select(state, node)
    else:
        raise StepFailed(f"{node.describe()} cannot be appended; use s.fork(n) / s.join(...)")


def resolve_sampling(node: Gen, defaults: SamplingArgs) -> SamplingArgs:
    """The node's own sampling fields, else the run's defaults."""
    def pick(key: str):
        value = getattr(node, key)
        return getattr(defaults, key) if value is None else value

    return SamplingArgs(max_tokens=pick("max_tokens"), stop=pick("stop"),
                        temperature=pick("temperature"), top_p=pick("top_p"), seed=pick("seed"))


def _gen(state: ProgramState, node: Gen) -> None:
    if node.reasoning:
        _gen_reasoning(state, node)
        return
    if node.tools is not None:
        _gen_tools(state, node)
        return
    ctx = state.ctx
    prompt = state.prompt()
    sampling = resolve_sampling(node, ctx.defaults)
    constraint = constraint_of(node)
    if ctx.stream:
        out = GenOutput("")
        for item in ctx.backend.stream(prompt, sampling, constraint):
            if isinstance(item, GenOutput):
                out = item
            else:
                state.apply_text(item, node.name)
    else:
        out = ctx.backend.generate(prompt, sampling, constraint)
        state.apply_text(out.text, node.name)
    state.set_var(node.name, parse_output(node, out.text), out.meta)


def _gen_tools(state: ProgramState, node: Gen) -> None:
    """A chat request with tools; the calls go into the assistant turn and ``s.tool_calls``.
    Not streamed even under ``stream=True`` (the text arrives in one piece): a call is only
    known once its arguments are complete."""
    ctx = state.ctx
    prompt = state.chat_prompt("a gen with tools is sent as chat messages (the server renders "
                               "the tools)")
    tools = ToolsArgs(node.tools or [], node.tool_choice, node.parallel_tool_calls)
    out = ctx.backend.generate_tools(prompt, resolve_sampling(node, ctx.defaults), tools)
    state.apply_text(out.text, node.name)
    state.set_tool_calls(node.name, out.tool_calls)
    state.set_var(node.name, out.text, {**out.meta, "tool_calls": out.tool_calls})


def _gen_reasoning(state: ProgramState, node: Gen) -> None:
    """A chat request whose thinking is kept apart: the answer goes into the assistant turn
    and ``s[name]``, the thinking into ``s.reasoning(name)`` (a reasoning model's template
    leaves earlier thinking out of the history too). Not streamed, as a gen with tools."""
    ctx = state.ctx
    prompt = state.chat_prompt("a gen with reasoning is sent as chat messages (the server "
                               "splits the thinking off)")
    tools = (None if node.tools is None
             else ToolsArgs(node.tools, node.tool_choice, node.parallel_tool_calls))
    out = ctx.backend.generate_message(prompt, resolve_sampling(node, ctx.defaults),
                                       constraint_of(node), tools, node.reasoning_effort)
    state.apply_text(out.text, node.name)
    if tools is not None:
        state.set_tool_calls(node.name, out.tool_calls)
    state.set_reasoning(node.name, out.reasoning)
    meta = {**out.meta, "reasoning": out.reasoning}
    if tools is not None:
        meta["tool_calls"] = out.tool_calls
    state.set_var(node.name, parse_output(node, out.text), meta)


def _select(state: ProgramState, node: Select) -> None:
    out = state.ctx.backend.select(state.prompt(), node.choices)
    choice = node.choices[out.index]
    state.apply_text(choice, node.name)
    meta = {"scores": out.normalized, "sums": out.sums, "num_tokens": out.num_tokens}
    state.set_var(node.name, choice, meta)
