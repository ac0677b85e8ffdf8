"""The variables a Jinja chat template reads, so that ``chat_template_kwargs`` can be honoured or
refused by name.

A template reads a variable it does not set itself (``enable_thinking`` in Qwen3's). A key of
``chat_template_kwargs`` that no template expression reads would change nothing, so it is a 400
naming it rather than silently dropped (vLLM passes such keys on and the template ignores them).
"""

from __future__ import annotations

import jinja2
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def template_variables(template: str | None) -> frozenset[str] | None:
    """The names ``template`` reads without setting them, or None when it cannot be parsed (then
    no name can be refused; rendering reports the template's own error).

    Parsed as Hugging Face parses chat templates (a sandboxed environment with the loop-control
    extension); filters and tests are not resolved at parse time, so none need be installed.
    """
    if not template:
        return frozenset()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None
