"""Whether an OpenAI-compatible server enforces an EBNF grammar sent in a body field (``ebnf``
for splitserve and SGLang; llama.cpp's server calls it ``grammar``): a server may refuse an
unknown field (HTTP 400) or ignore it and answer unconstrained, so it is probed, never assumed."""

from __future__ import annotations

from typing import Any

from splitserve.lang.errors import BackendError
from splitserve.lang.http_client import OpenAIHTTP, completion_output

PROBE_OUTPUT = "zqqz"  # what no unconstrained model writes after the probe prompt
PROBE_GRAMMAR = f'root ::= "{PROBE_OUTPUT}"\n'


def probe_grammar_field(http: OpenAIHTTP, model: str, field: str, chat: bool) -> str | None:
    """Send a grammar that allows only ``zqqz`` in ``field``.

    Args:
        http: the server's connection.
        model: the model name to send.
        field: the body field that carries the grammar.
        chat: probe ``/chat/completions`` (else ``/completions``).

    Returns:
        None when the answer is exactly ``zqqz`` (the grammar was enforced), else why not.

    Raises:
        BackendError: the server is unreachable or failed (not a 4xx).
    """
    body: dict[str, Any] = {"model": model, "max_tokens": 8, "temperature": 0.0,
                            field: PROBE_GRAMMAR}
    if chat:
        path, body["messages"] = "/chat/completions", [{"role": "user", "content": "0"}]
    else:
        path, body["prompt"] = "/completions", "0"
    try:
        text = completion_output(http.post(path, body), chat).text
    except BackendError as exc:
        if exc.status_code is not None and 400 <= exc.status_code < 500:
            return f"it refused the {field!r} field on {path} ({exc})"
        raise
    if text == PROBE_OUTPUT:
        return None
    return (f"it ignored the {field!r} field on {path} (a probe grammar that allows only "
            f"{PROBE_OUTPUT!r} came back as {text[:40]!r})")


def unsupported_grammar(url: str, why: str) -> BackendError:
    """The error of a ``gen(grammar=...)`` the server at ``url`` cannot enforce."""
    return BackendError(f"the server at {url} does not enforce EBNF grammars (gen(grammar=...)):"
                        f" {why}; it needs grammar-constrained decoding (splitserve, SGLang)",
                        unsupported=True)
