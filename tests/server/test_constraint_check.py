"""The json_schema safety net: a finished output that breaks its schema is counted, and under
strict it becomes an error; valid, cut (``length``) and non-schema outputs pass untouched."""

from __future__ import annotations

import json

import anyio
import pytest
from prometheus_client import CollectorRegistry, Counter

from splitserve.ipc.messages import Constraint, SamplingParams
from splitserve.server.constraint_check import checked_pieces, partial_header, violation
from splitserve.server.errors import APIError
from splitserve.server.formatter import ResponseFormatter, Usage
from splitserve.server.generation import Piece
from splitserve.server.job import Job

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                     "required": ["n"]})


def _job(constraint: Constraint | None, stop: list[str] | None = None) -> Job:
    fmt = ResponseFormatter("r", 0, "m", True, False)
    return Job("r", [1], SamplingParams(constraint=constraint), stop or [], fmt, Usage(1))


async def _pieces(*texts: str, finish: str = "stop"):
    for text in texts[:-1]:
        yield Piece(text)
    yield Piece(texts[-1], finish)


def _run(job: Job, counter: Counter, *texts: str, finish: str = "stop") -> str:
    async def main() -> str:
        out = []
        async for piece in checked_pieces(job, _pieces(*texts, finish=finish), counter):
            out.append(piece.text)
        return "".join(out)

    return anyio.run(main)


def _counter() -> Counter:
    return Counter("v", "v", ["backend"], registry=CollectorRegistry())


def _total(counter: Counter) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name == "v_total")


def test_violation_names_the_problem() -> None:
    assert violation(SCHEMA, '{"n":3}') is None
    assert "12 is greater than the maximum of 9" in violation(SCHEMA, '{"n":12}')
    assert violation(SCHEMA, '{"n":').startswith("not JSON")


def test_non_strict_violation_is_counted_and_passed_on() -> None:
    counter = _counter()
    assert _run(_job(Constraint("json_schema", SCHEMA)), counter, '{"n":', "12}") == '{"n":12}'
    assert _total(counter) == 1
    assert _run(_job(Constraint("json_schema", SCHEMA)), counter, '{"n":3}') == '{"n":3}'
    assert _total(counter) == 1


def test_strict_violation_is_an_error() -> None:
    counter = _counter()
    with pytest.raises(APIError, match="broke its strict json_schema") as info:
        _run(_job(Constraint("json_schema", SCHEMA, strict=True)), counter, '{"n":12}')
    assert info.value.status_code == 500 and info.value.code == "constraint_violation"
    assert _total(counter) == 1


def test_cut_stop_string_and_other_kinds_are_not_checked() -> None:
    counter = _counter()
    strict = Constraint("json_schema", SCHEMA, strict=True)
    assert _run(_job(strict), counter, '{"n":', finish="length") == '{"n":'
    assert _run(_job(strict, stop=["}"]), counter, '{"n":1') == '{"n":1'
    assert _run(_job(Constraint("regex", "a+")), counter, "b") == "b"
    assert _total(counter) == 0


def test_partial_header_names_ignored_keywords() -> None:
    unique = json.dumps({"type": "array", "uniqueItems": True})
    assert partial_header(_job(Constraint("json_schema", unique))) == {
        "x-splitserve-constraint": "partial; ignored=uniqueItems@/"}
    assert partial_header(_job(Constraint("json_schema", SCHEMA))) == {}
    assert partial_header(_job(None)) == {}
