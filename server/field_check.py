"""The request-field check of ``server.fields``' table and ``server.nested_fields``' sub-field
tables, run on each body before it is parsed.

It refuses (HTTP 400, OpenAI's error body, ``param`` naming the field, nested ones by their
dotted path: ``messages[2].audio``) a field we do not serve and a number or choice outside the
field's documented range; everything else is left to the pydantic models of
``server.protocol``, which check types and shapes (a value of the wrong shape is skipped here).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from splitserve.server.errors import APIError
from splitserve.server.fields import FIELDS, Endpoint, FieldRule
from splitserve.server.nested_fields import NESTED_FIELDS, path_steps


def check_fields(endpoint: Endpoint, body: Any) -> None:
    """Refuse what ``endpoint``'s tables refuse in ``body`` (a decoded JSON value; anything but
    an object is left to the parser): its fields, then its nested objects' sub-fields.

    Raises:
        APIError: 400 with ``code`` ``unsupported_parameter`` for a refused field or sub-field;
            a value outside its range is a 400 with ``code`` null, as the parser's own errors
            are.
    """
    if not isinstance(body, dict):
        return
    _check_object("", body, FIELDS[endpoint])
    for path, table in NESTED_FIELDS[endpoint].items():
        for where, obj in objects_at(body, path_steps(path)):
            _check_object(where, obj, table)


def objects_at(value: Any, steps: list[tuple[str, bool]], where: str = ""
               ) -> Iterator[tuple[str, dict[str, Any]]]:
    """The objects of ``value`` at the path ``steps`` (``nested_fields.path_steps``), each with
    its dotted path as a client wrote it (``messages[2]``). A value of another shape than the
    path expects is passed over: the parser reports it."""
    if not steps:
        if isinstance(value, dict):
            yield where, value
        return
    (key, is_list), rest = steps[0], steps[1:]
    if not isinstance(value, dict) or key not in value:
        return
    child, at = value[key], f"{where}.{key}" if where else key
    if not is_list:
        yield from objects_at(child, rest, at)
    elif isinstance(child, list):
        for i, item in enumerate(child):
            yield from objects_at(item, rest, f"{at}[{i}]")


def check_table(where: str, obj: dict[str, Any], table: dict[str, FieldRule]) -> None:
    """Check the fields of ``obj`` (a body, or the nested object at ``where``, its dotted path)
    by ``table``, as :func:`check_fields` does: for the endpoints whose tables live elsewhere
    (``server.responses_api.fields``).

    Raises:
        APIError: as :func:`check_fields`.
    """
    _check_object(where, obj, table)


def _check_object(where: str, obj: dict[str, Any], table: dict[str, FieldRule]) -> None:
    """Check the fields of ``obj`` (the body, or the nested object at ``where``) by ``table``."""
    for key, value in obj.items():
        rule = table.get(key)
        if rule is None:
            continue
        check_value(f"{where}.{key}" if where else key, value, rule)


def check_value(name: str, value: Any, rule: FieldRule) -> None:
    """Refuse the value of the field ``name`` (its dotted path) as ``rule`` says: a refused
    field not null nor a no-op value, or an implemented one outside its range or ``enum``.

    Raises:
        APIError: as :func:`check_fields`.
    """
    if value is None:
        return
    if rule.status == "refused":
        _check_refused(name, value, rule)
    elif rule.status == "implemented":
        _check_range(name, value, rule)


def _check_refused(name: str, value: Any, rule: FieldRule) -> None:
    # ``==`` would take 0 for False and 1.0 for 1: compare types too.
    if any(type(value) is type(v) and value == v for v in rule.noop):
        return
    accepted = " or ".join(["null", *(json.dumps(v) for v in rule.noop)])
    raise APIError(f"{name}: not supported by this server ({rule.note}); remove it or send "
                   f"{accepted}", param=name, code="unsupported_parameter")


def _check_range(name: str, value: Any, rule: FieldRule) -> None:
    if rule.enum is not None and value not in rule.enum:
        choices = ", ".join(repr(v) for v in rule.enum)
        raise APIError(f"{name}: {value!r} is not one of {choices}", param=name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return  # not a number: the type check in server.protocol names the error
    if not math.isfinite(value) and (rule.minimum is not None or rule.maximum is not None):
        raise APIError(f"{name}: {value} is not a finite number", param=name)
    if rule.minimum is not None and value < rule.minimum:
        raise APIError(f"{name}: {value} is below the minimum {_num(rule.minimum)}",
                       param=name)
    if rule.maximum is not None and value > rule.maximum:
        raise APIError(f"{name}: {value} is above the maximum {_num(rule.maximum)}",
                       param=name)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
