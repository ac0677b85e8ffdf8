"""A function's ``parameters`` JSON Schema as an EBNF grammar of pythonic keyword arguments.

``{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
"required": ["city"]}`` becomes the arguments ``city="Paris"`` or ``city="Paris", days=3``:
keyword arguments in the schema's property order, each required one present, each optional one
present or not, values as Python literals of their types. Canonical spacing (``, `` between
arguments and items, ``: `` in dicts), as the JSON grammar's compact default, so greedy decoding
spends no tokens on whitespace.

Enforced: ``type`` (string, integer, number, boolean, null, array, object, and lists of them),
``properties``, ``required``, ``items``, ``enum``, ``const`` and ``anyOf``; an object without
``properties`` is any dict, a schema without ``type`` any literal, and no keyword argument or
key outside ``properties`` is allowed (``additionalProperties`` is thus kept, and a schema that
would allow more only loses instances). Every other keyword with a meaning for the value
(``pattern``, ``minimum``, ``oneOf``, ``$ref``...) is not enforced: :func:`unenforced` names
each with its JSON pointer, and a ``strict`` function using one is a 400.

The grammar text is xgrammar's EBNF (``xgrammar.Grammar.from_ebnf``), used inside a structural
tag's ``grammar`` format (``server.tools.grammar``).
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.server.tools.formats import python_literal

# Keywords that say nothing about which values are valid, or that the grammar enforces.
_ENFORCED = frozenset({"type", "properties", "required", "items", "enum", "const", "anyOf",
                       "additionalProperties"})
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                          "$comment", "deprecated", "readOnly", "writeOnly"})

_COMMON = r'''
py_str ::= "\"" py_char* "\""
py_char ::= [^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])
py_int ::= "-"? ("0" | [1-9] [0-9]*)
py_num ::= py_int ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
py_bool ::= "True" | "False"
py_none ::= "None"
py_any ::= py_str | py_num | py_bool | py_none | py_list | py_dict
py_list ::= "[" (py_any (", " py_any)*)? "]"
py_dict ::= "{" (py_str ": " py_any (", " py_str ": " py_any)*)? "}"
'''


class _Builder:
    """Collects the rules of one grammar; each schema gets a rule named after its place."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

    def value(self, schema: Any, name: str) -> str:
        """The rule (or literal) matching one value of ``schema``."""
        if not isinstance(schema, dict):
            return "py_any"
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema and isinstance(schema["enum"], list):
            return self._rule(name, " | ".join(_literal(v) for v in schema["enum"]) or '""')
        if "anyOf" in schema and isinstance(schema["anyOf"], list):
            alts = [self.value(s, f"{name}_any{i}") for i, s in enumerate(schema["anyOf"])]
            return self._rule(name, " | ".join(alts))
        kind = schema.get("type")
        if isinstance(kind, list):
            alts = [self.value({**schema, "type": k}, f"{name}_{k}") for k in kind]
            return self._rule(name, " | ".join(alts))
        simple = {"string": "py_str", "integer": "py_int", "number": "py_num",
                  "boolean": "py_bool", "null": "py_none"}
        if kind in simple:
            return simple[kind]
        if kind == "array":
            item = self.value(schema.get("items", {}), f"{name}_item")
            return self._rule(name, f'"[" ({item} (", " {item})*)? "]"')
        if kind == "object":
            props = schema.get("properties")
            if not isinstance(props, dict):
                return "py_dict"
            body = self.ordered(props, schema.get("required") or [], name,
                                lambda key: f'{json.dumps(json.dumps(key))} ": "')
            return self._rule(name, f'"{{" {body} "}}"')
        return "py_any"

    def ordered(self, props: dict[str, Any], required: list[str], name: str,
                head: Any) -> str:
        """Properties in order, separated by ``, ``: each required one, each optional one or
        not. ``head(key)``: the EBNF before a property's value (``key=`` or ``"key": ``)."""
        keys = list(props)
        # rest(i, c): the properties from i on, c: whether one was written before (", " first).
        for i in range(len(keys), -1, -1):
            for c in (0, 1):
                rule = f"{name}_r{i}_{c}"
                if i == len(keys):
                    self.rules[rule] = '""'
                    continue
                key = keys[i]
                sep = '", " ' if c else ""
                value = self.value(props[key], f"{name}_p{i}")
                alts = [f"{sep}{head(key)} {value} {name}_r{i + 1}_1"]
                if key not in required:
                    alts.append(f"{name}_r{i + 1}_{c}")
                self.rules[rule] = " | ".join(f"({a})" for a in alts)
        return f"{name}_r0_0"

    def _rule(self, name: str, body: str) -> str:
        self.rules[name] = body
        return name


def arguments_grammar(functions: list[tuple[str, dict[str, Any]]]
                      ) -> tuple[str, list[str], list[str]]:
    """The EBNF rules of each function's call ``NAME(ARGS)``, without a root.

    Returns:
        ``(rules, calls, args)``: the rules' text, and per function the rule of its call and
        of its arguments.
    """
    builder = _Builder()
    calls, args = [], []
    for i, (name, schema) in enumerate(functions):
        props = schema.get("properties") if isinstance(schema, dict) else None
        if isinstance(props, dict):
            arg = builder.ordered(props, schema.get("required") or [], f"f{i}",
                                  lambda key: json.dumps(f"{key}="))
        else:  # any keyword arguments
            arg = builder._rule(f"f{i}_any", '(py_kw (", " py_kw)*)?')
        builder.rules[f"call{i}"] = f'{json.dumps(name + "(")} {arg} ")"'
        calls.append(f"call{i}")
        args.append(arg)
    builder.rules["py_kw"] = '[A-Za-z_] [A-Za-z0-9_]* "=" py_any'
    text = "\n".join(f"{rule} ::= {body}" for rule, body in builder.rules.items())
    return text + _COMMON, calls, args


def call_list_grammar(functions: list[tuple[str, dict[str, Any]]], one: bool) -> str:
    """The EBNF of a call list ``[call, call, ...]`` (``one``: exactly one call)."""
    rules, calls, _ = arguments_grammar(functions)
    any_call = " | ".join(calls)
    more = "" if one else f' (", " ({any_call}))*'
    return f'root ::= "[" ({any_call}){more} "]"\n{rules}'


def rest_of_list_grammar(functions: list[tuple[str, dict[str, Any]]], index: int,
                         one: bool) -> str:
    """The EBNF of a call list after its opening ``[NAME(`` (``NAME``: ``functions[index]``),
    up to its closing ``]`` exclusive: that call's arguments and ``)``, then, unless ``one``,
    more calls."""
    rules, calls, args = arguments_grammar(functions)
    more = "" if one else f' (", " ({" | ".join(calls)}))*'
    return f'root ::= {args[index]} ")"{more}\n{rules}'


def unenforced(schema: Any, pointer: str = "") -> list[str]:
    """The keywords of ``schema`` this grammar does not enforce, as ``keyword at /pointer``."""
    out: list[str] = []
    if not isinstance(schema, dict):
        return out
    for key, value in schema.items():
        here = f"{pointer}/{key}"
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            out.append(f"{key} at {pointer or '/'}")
            continue
        if key == "properties" and isinstance(value, dict):
            for name, sub in value.items():
                out += unenforced(sub, f"{here}/{name}")
        elif key == "items":
            out += unenforced(value, here)
        elif key == "anyOf" and isinstance(value, list):
            for i, sub in enumerate(value):
                out += unenforced(sub, f"{here}/{i}")
    return out


def _literal(value: Any) -> str:
    """A JSON value as the EBNF string of its Python literal."""
    return json.dumps(python_literal(value), ensure_ascii=False)
