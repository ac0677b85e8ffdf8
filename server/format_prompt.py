"""``response_format.json_schema.description`` shown to the model, as OpenAI documents it ("used
by the model to determine how to respond in the format").

The grammar holds the output to the schema whatever the prompt says; the description is the one
part of the format meant for the model itself, so a chat request's description becomes a line
of its system message. (vLLM parses it and uses only the schema; a client that sends one, such
as pydantic-ai's ``NativeOutput`` for a documented model, gets it seen here.) On
``/v1/completions`` the prompt is the client's own text and nothing is added to it: there the
sub-field is refused (``server.nested_fields``).
"""

from __future__ import annotations

from typing import Any

from splitserve.server.tools.prompt import join_system


def with_format_description(
    messages: list[dict[str, Any]], name: str, description: str, default_system: str = ""
) -> list[dict[str, Any]]:
    """``messages`` (Hugging Face chat-template dicts) with ``Respond in the JSON format
    "<name>": <description>`` appended to the first system message, or as a new system message
    in front when there is none (after ``default_system``, the template's default system
    prompt, which it would otherwise replace); an empty ``description`` leaves them as they
    are. The input list and its dicts are not changed."""
    if not description:
        return messages
    line = f'Respond in the JSON format "{name}": {description}'
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = join_system(first.get("content") or "", line)
        return [first, *messages[1:]]
    return [{"role": "system", "content": join_system(default_system, line)}, *messages]
