"""Turn a request's constraint fields into the one ``Constraint`` its workers compile.

The grammar itself is checked where it is compiled (the workers, off their loops); a constraint
that does not compile comes back from there as a 400 naming the problem. The one check made here
is ``strict: true`` against the measured keyword limits of every backend (``constraints.
schema_limits``): when no backend enforces the whole schema, a 400 naming each keyword and its
JSON pointer, before any work.
"""

from __future__ import annotations

import json

from splitserve.config.registry import GRAMMAR_BACKEND
from splitserve.constraints.chain import ChainPlan, plan_chain
from splitserve.ipc.messages import Constraint
from splitserve.server.errors import APIError
from splitserve.server.protocol import BaseGenerateRequest


def constraint_from_request(req: BaseGenerateRequest) -> Constraint | None:
    """The request's constraint, or None for free text.

    Raises:
        APIError: more than one constraint field is set (400 naming them), or a ``strict``
            JSON schema uses keywords no grammar backend enforces (400 naming each and where).
    """
    found: list[tuple[str, Constraint]] = []
    flexible = req.whitespace_flexible
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", Constraint("json_object", whitespace_flexible=flexible)))
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema.schema_
        if schema is None:
            found.append(("response_format", Constraint("json_object",
                                                        whitespace_flexible=flexible)))
        else:
            strict = bool(fmt.json_schema.strict)
            text = json.dumps(schema)
            if strict:
                _refuse_unenforceable(text)
            found.append(("response_format", Constraint("json_schema", text, strict, flexible)))
    if req.regex is not None:
        found.append(("regex", Constraint("regex", req.regex)))
    if req.ebnf is not None:
        found.append(("ebnf", Constraint("ebnf", req.ebnf)))
    if req.choice is not None:
        found.append(("choice", Constraint("choice", json.dumps(req.choice))))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(
            f"only one constraint per request is supported; got {names}", param=found[1][0]
        )
    return found[0][1] if found else None


def constraint_plan(constraint: Constraint) -> ChainPlan:
    """Returns: the backend chain the workers walk for ``constraint`` (every registered backend
    in registry order; ``config.engine.grammar_backend`` only moves one to the front, which does
    not change which are sound)."""
    return plan_chain(constraint.kind, constraint.text, GRAMMAR_BACKEND.names,
                      strict=constraint.strict)


def _refuse_unenforceable(text: str) -> None:
    plan = plan_chain("json_schema", text, GRAMMAR_BACKEND.names, strict=True)
    if plan.sound:
        return
    per_backend = "; ".join(
        f"{name}: {', '.join(items)}" for name, items in plan.ignored_by_all.items()
    )
    raise APIError(
        "response_format.json_schema.strict is true, but no grammar backend enforces every "
        f"keyword of this schema (not enforced, per backend: {per_backend}): remove these "
        "keywords or set strict to false (then the response carries an "
        "x-splitserve-constraint: partial header naming them)",
        param="response_format",
    )
