"""The check of ``server.responses_api.fields``' tables, run on each ``POST /v1/responses`` body
before it is parsed: a refused field, sub-field, kind or ``include`` value is a 400 in OpenAI's
error shape naming it (``tools[0].type``, ``input[3].caller``, ``include[1]``); a number out
of its documented range too. Shapes and types are left to ``server.responses_api.protocol``.
"""

from __future__ import annotations

from typing import Any

from splitserve.server.errors import APIError
from splitserve.server.field_check import check_table, objects_at
from splitserve.server.nested_fields import path_steps
from splitserve.server.responses_api.fields import (
    INCLUDE_VALUES,
    RESPONSES_FIELDS,
    RESPONSES_NESTED,
    RESPONSES_TYPED,
    TypedTable,
)


def check_request(body: Any) -> None:
    """Refuse what the tables refuse in ``body`` (a decoded JSON value; anything but an object
    is left to the parser): its fields, its nested objects' sub-fields, each typed object's
    kind and then its sub-fields, and the ``include`` values.

    Raises:
        APIError: 400, ``code`` ``unsupported_parameter`` for what is refused, null for a
            value out of range.
    """
    if not isinstance(body, dict):
        return
    check_table("", body, RESPONSES_FIELDS)
    for path, table in RESPONSES_NESTED.items():
        for where, obj in objects_at(body, path_steps(path)):
            check_table(where, obj, table)
    for path, typed in RESPONSES_TYPED.items():
        for where, obj in objects_at(body, path_steps(path)):
            check_kind(where, obj, typed)
    include = body.get("include")
    if isinstance(include, list):
        for i, value in enumerate(include):
            rule = INCLUDE_VALUES.get(value) if isinstance(value, str) else None
            if rule is not None and rule.status == "refused":
                raise APIError(f"include[{i}]: {value!r} is not supported by this server "
                               f"({rule.note}); remove it", param=f"include[{i}]",
                               code="unsupported_parameter")


def check_kind(where: str, obj: dict[str, Any], typed: TypedTable) -> None:
    """Check one typed object: its kind (``type``, or the table's default) must not be refused,
    and its sub-fields go by that kind's table. An unknown or missing kind is left to the
    parser, which names what it expects.

    Raises:
        APIError: 400 naming ``<where>.type`` for a refused kind, or the sub-field.
    """
    name = obj.get("type", typed.default)
    rule = typed.kinds.get(name) if isinstance(name, str) else None
    if rule is None:
        return
    if rule.status == "refused":
        raise APIError(f"{where}.type: {name!r} is not supported by this server ({rule.note})",
                       param=f"{where}.type", code="unsupported_parameter")
    check_table(where, obj, rule.fields)
