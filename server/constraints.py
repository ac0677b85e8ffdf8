"""Turn a request's constraint fields into the one ``Constraint`` its workers compile.

The grammar itself is checked where it is compiled (the workers, off their loops); a constraint
that does not compile comes back from there as a 400 naming the problem. The one check made here
is ``strict: true`` against keywords no grammar backend enforces (a 400 before any work).
"""

from __future__ import annotations

import json

from splitserve.engine.grammar.schema_limits import unenforced_keywords
from splitserve.ipc.messages import Constraint
from splitserve.server.errors import APIError
from splitserve.server.protocol import BaseGenerateRequest


def constraint_from_request(req: BaseGenerateRequest) -> Constraint | None:
    """The request's constraint, or None for free text.

    Raises:
        APIError: more than one constraint field is set (400 naming them), or a ``strict``
            JSON schema uses keywords the grammar cannot enforce (400 naming each and where).
    """
    found: list[tuple[str, Constraint]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", Constraint("json_object")))
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema.schema_
        if schema is None:
            found.append(("response_format", Constraint("json_object")))
        else:
            if fmt.json_schema.strict:
                _refuse_unenforceable(schema)
            found.append(("response_format", Constraint("json_schema", json.dumps(schema))))
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


def _refuse_unenforceable(schema: dict | bool) -> None:
    unenforced = unenforced_keywords(schema)
    if unenforced:
        raise APIError(
            "response_format.json_schema.strict is true, but the grammar cannot enforce "
            f"{'; '.join(unenforced)}: remove these keywords or set strict to false "
            "(then they are not enforced)",
            param="response_format",
        )
