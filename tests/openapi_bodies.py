"""Request bodies drawn from OpenAI's spec (``tests/data/openai-openapi/openapi.json``) for
fuzzing, with schemathesis' generator (hypothesis-jsonschema 0.23 no longer runs on current
hypothesis).

The spec is OpenAPI: its schemas refer to each other by ``$ref`` and mark nulls with
``nullable``. :func:`request_schema` turns one request schema into a self-contained JSON Schema
to draw from: references inlined (to a depth, so recursive schemas
end), ``nullable`` as an ``anyOf`` with null, ``oneOf`` as ``anyOf`` (a body matching two
alternatives is still a body a client may send), and documentation keys dropped. Sizes are
capped so that each body is cheap to serve: strings, arrays and maps stay short, and the fields
that set how many tokens to generate are required and small.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

SPEC = Path(__file__).resolve().parent / "data" / "openai-openapi" / "openapi.json"
SCHEMAS = {"chat": "CreateChatCompletionRequest", "completions": "CreateCompletionRequest",
           "responses": "CreateResponse"}
MAX_DEPTH = 12  # of inlined references; deeper ones become "any object"
INPUT_KINDS_PER_DRAW = 8  # Responses input-item kinds in one drawn schema (see input_item_groups)
DROPPED = {"description", "example", "examples", "deprecated", "discriminator", "title",
           "default", "format", "readOnly", "writeOnly", "externalDocs", "$recursiveAnchor"}


@cache
def _components() -> dict[str, Any]:
    return json.loads(SPEC.read_text())["components"]["schemas"]


def _convert(node: Any, depth: int) -> Any:
    if isinstance(node, list):
        return [_convert(x, depth) for x in node]
    if not isinstance(node, dict):
        return node
    if "$recursiveRef" in node:  # a recursive filter (the Responses tools'): one level here
        return {"type": "object", "maxProperties": 0}
    if "$ref" in node:
        if depth >= MAX_DEPTH:
            return {"type": "object", "maxProperties": 0}
        target = _components()[node["$ref"].rsplit("/", 1)[1]]
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return _convert({**target, **rest}, depth + 1)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in DROPPED or key.startswith("x-") or key == "nullable":
            continue
        if key == "oneOf":
            key = "anyOf"
        if key in ("properties", "patternProperties", "$defs"):
            out[key] = {k: _convert(v, depth) for k, v in value.items()}
        elif key in ("minimum", "maximum") and isinstance(value, float) and value.is_integer():
            # The spec writes +-2^63 as a rounded float; integer bounds must be integers.
            out[key] = math.floor(value) if key == "maximum" else math.ceil(value)
        else:
            out[key] = _convert(value, depth)
    if "anyOf" in out and "allOf" not in out:
        # Keys next to anyOf apply to every alternative; fold them in to keep each one plain.
        shared = {k: v for k, v in out.items() if k != "anyOf"}
        if shared and all(isinstance(a, dict) for a in out["anyOf"]):
            out = {"anyOf": [{**shared, **a} for a in out["anyOf"]]}
    _cap(out)
    if node.get("nullable"):
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _cap(schema: dict[str, Any]) -> None:
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "string" in types:
        schema["maxLength"] = min(schema.get("maxLength", 40), 40)
    if "array" in types:
        schema["maxItems"] = min(schema.get("maxItems", 3), 3)
        schema["minItems"] = min(schema.get("minItems", 0), schema["maxItems"])
    if "object" in types:
        schema["maxProperties"] = min(schema.get("maxProperties", 6), 6)


def request_schema(endpoint: str, *, only: set[str] | None = None,
                   caps: dict[str, dict] | None = None,
                   required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON Schema of ``endpoint``'s request body (``"chat"`` or ``"completions"``).

    Args:
        only: keep just these properties (e.g. the fields a server implements).
        caps: property -> schema that replaces the spec's (e.g. a small ``max_tokens``).
        required: properties every body must carry, besides the spec's required ones.
    """
    props: dict[str, Any] = {}
    req: list[str] = []
    stack = [{"$ref": f"#/components/schemas/{SCHEMAS[endpoint]}"}]
    while stack:
        node = stack.pop()
        while "$ref" in node:
            node = _components()[node["$ref"].rsplit("/", 1)[1]]
        stack.extend(node.get("allOf", []))
        props.update(node.get("properties", {}))
        req += node.get("required", [])
    if only is not None:
        props = {k: v for k, v in props.items() if k in only}
    out = {k: _convert(v, 0) for k, v in props.items()}
    out.update({k: v for k, v in (caps or {}).items() if k in out})
    return {"type": "object", "properties": out, "additionalProperties": False,
            "required": sorted({*req, *required} & set(out))}


def input_item_groups(size: int = INPUT_KINDS_PER_DRAW) -> list[dict[str, Any]]:
    """Schemas of the Responses ``input`` (a string, or a list of items), each with the items
    of a group of at most ``size`` of the spec's input-item kinds, together all of them: a draw
    over these groups (``caps={"input": group}``, one strategy per group, joined with
    ``one_of``) covers every kind. One schema with the whole union (30 kinds) is more than
    schemathesis 4 generates from ("does not support this part of it"), and so is a second
    copy of the tool union in one body: the two kinds that carry a ``tools`` list of it
    (``tool_search_output``, ``additional_tools``, both refused by their ``type``) get a list
    of empty objects instead."""
    def flat(node: dict[str, Any]) -> list[dict[str, Any]]:
        if set(node) == {"anyOf"}:
            return [leaf for alt in node["anyOf"] for leaf in flat(alt)]
        return [node]

    kinds = flat(_convert({"$ref": "#/components/schemas/InputItem"}, 0))
    for kind in kinds:
        props = kind.get("properties", {})
        if "tools" in props and "anyOf" in json.dumps(props["tools"]):
            props["tools"] = {"type": "array", "maxItems": 3,
                              "items": {"type": "object", "maxProperties": 0}}
    return [{"anyOf": [{"type": "string", "maxLength": 40},
                       {"type": "array", "maxItems": 3, "minItems": 0,
                        "items": {"anyOf": kinds[i:i + size]}}]}
            for i in range(0, len(kinds), size)]


def whole_numbers_as_ints(value: Any) -> Any:
    """``1.0`` -> ``1`` throughout: the generator writes JSON Schema integers as floats at
    times, which our strict parser refuses (a 400), so bodies meant to go deep are given ints."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [whole_numbers_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: whole_numbers_as_ints(v) for k, v in value.items()}
    return value


def body_strategy(endpoint: str, path: str, *, ints: bool = False, **kw: Any):
    """A hypothesis strategy of request bodies (dicts) for ``endpoint`` at ``path``; ``kw`` as
    in :func:`request_schema`; ``ints``: :func:`whole_numbers_as_ints` on each body."""
    import schemathesis

    doc = {"openapi": "3.1.0", "info": {"title": "fuzz", "version": "1"}, "paths": {path: {
        "post": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": request_schema(endpoint, **kw)}}},
            "responses": {"200": {"description": "ok"}}}}}}
    cases = schemathesis.openapi.from_dict(doc)[path]["POST"].as_strategy()
    bodies = cases.map(lambda case: case.body).filter(lambda body: isinstance(body, dict))
    return bodies.map(whole_numbers_as_ints) if ints else bodies


def check_openai_answer(status: int, text: str, content_type: str) -> None:
    """No 5xx; every error an OpenAI error body; every SSE error event one too.

    Raises:
        AssertionError: saying which rule the answer broke.
    """
    assert status < 500, f"HTTP {status}: {text[:2000]}"
    if status >= 400:
        err = json.loads(text)["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), text
        return
    if content_type.startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                event = json.loads(line[6:])
                err = event.get("error")
                if err is not None:
                    assert isinstance(err["message"], str) and isinstance(err["type"], str), line
                    assert err["type"] != "server_error", line  # a 5xx in the stream
                # The Responses API's: an ``error`` event, then ``response.failed``.
                if event.get("type") == "error":
                    assert isinstance(event["message"], str) and "code" in event, line
                    assert event["code"] != "server_error", line
                if event.get("type") == "response.failed":
                    assert event["response"]["error"]["code"] != "server_error", line


# What every fuzzed body carries so that serving it stays cheap: the served model, a few new
# tokens at most, and few choices (``n`` may still be out of range, to test the check).
SMALL = {"model": {"const": "default"},
         "max_tokens": {"type": "integer", "minimum": 0, "maximum": 3},
         "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 3},
         # The Responses API's minimum is 16 (15: the range check).
         "max_output_tokens": {"type": "integer", "minimum": 15, "maximum": 16},
         "n": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 2}, {"type": "null"}]}}
TOKEN_CAP = {"chat": ("max_completion_tokens",), "completions": ("max_tokens",),
             "responses": ("max_output_tokens",)}
