"""A program that does one ordinary Python operation on its generated values, picked by name.

Shared by the fake-backend and the launched-cluster tests: ``d`` is a generated digit (text),
``m`` a ``dtype=int`` result; each operation is the first use of a model output, so the trace
must stop exactly there and ``run_batch`` must still equal ``run``.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve import lang

# Long enough (>= MIN_SHARED_CHARS) that run_batch warms it.
PREFIX = "Answer with one number.\nQ: How many legs has a dog?\nA: 4\n"

OPS: dict[str, Callable[[str, int], str]] = {
    "join": lambda d, m: " ".join([d, d]),  # noqa: FLY002 - the operation under test
    "fstring": lambda d, m: f"{d} and {m}",
    "format_spec": lambda d, m: f"{m:03d}",
    "format": lambda d, m: format(m, "d"),
    "str_format": lambda d, m: "{}-{}".format(d, m),  # noqa: UP032 - under test
    "percent": lambda d, m: "%s/%d" % (d, m),  # noqa: UP031 - under test
    "str": lambda d, m: str(m),
    "arith": lambda d, m: str(m * 2 - m // 3),
    "add": lambda d, m: str(m + 1),
    "radd": lambda d, m: str(1 + m),
    "concat": lambda d, m: d + "!",
    "rconcat": lambda d, m: "#" + d,
    "if": lambda d, m: "yes" if d else "no",
    "lt": lambda d, m: "big" if m < 5 else "small",
    "eq": lambda d, m: "same" if d == "4" else "other",
    "max": lambda d, m: str(max(m, 3)),
    "len": lambda d, m: str(len(d)),
    "index": lambda d, m: d[0],
    "slice": lambda d, m: d[:1],
    "int": lambda d, m: str(int(d) + 1),
    "float": lambda d, m: str(float(d) / 2),
    "iter": lambda d, m: "".join(c for c in d),
    "list": lambda d, m: "-".join(list(d)),
    "method": lambda d, m: d.strip().upper(),
    "contains": lambda d, m: "yes" if "4" in d else "no",
    "dict_key": lambda d, m: {"4": "four"}.get(d, "?"),
}


@lang.function
def ops_program(s, op: str):
    s += PREFIX + "Q: How many eyes has a cat?\nA: " + lang.gen("d", regex="[1-9]")
    s += "\nQ: How many days has a week?\nA: " + lang.gen("m", dtype=int)
    s += "\nSo: " + OPS[op](s["d"], s["m"]) + "\nQ: Name a color.\nA:"
    s += lang.gen("tail", max_tokens=2, stop="\n")
