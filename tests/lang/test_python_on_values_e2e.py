"""Ordinary Python on generated values under ``run_batch``, against a launched cluster: every item
gives what ``run`` gives (greedy), whatever operation first uses a model output in the trace."""

from __future__ import annotations

import pytest

from splitserve import lang
from tests.lang.python_ops import OPS, ops_program

pytestmark = pytest.mark.slow


# A few operations (each item costs six requests; tests/lang/test_trace_stops.py covers all of
# them on a fake backend): a join, an f-string, arithmetic on the dtype=int value.
E2E_OPS = ("join", "fstring", "arith")


def test_run_batch_equals_run_on_python_ops(endpoint, needs_constraints) -> None:
    batch = [{"op": op} for op in E2E_OPS]
    for kw in batch:  # each item's trace stops at its own operation, after two model calls
        tr = ops_program.trace(**kw)
        assert not tr.complete and [type(n).__name__ for n in tr.nodes] == [
            "ConstantText", "Gen", "ConstantText", "Gen"], (kw, tr.stopped_at)
    batched = ops_program.run_batch(batch, backend=endpoint, temperature=0, num_threads=4)
    for kw, got in zip(batch, batched):
        assert isinstance(got, lang.ProgramState), got
        want = ops_program.run(backend=endpoint, temperature=0, **kw)
        assert got.text() == want.text() and got.variables() == want.variables(), kw["op"]
        assert isinstance(got["m"], int)
        assert f"So: {OPS[kw['op']](got['d'], got['m'])}\n" in got.text()


def test_fork_branches_do_python_on_values(endpoint) -> None:
    @lang.function
    def tips(s, topic):
        s += "Give one word about " + topic + ":" + lang.gen("w", max_tokens=3, stop="\n")
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" Word {i}:" + lang.gen("x", max_tokens=3, stop="\n")
        forks.join()
        s += " Together: " + " ".join(f["x"].strip() for f in forks) + "."

    batch = [{"topic": "the sea"}, {"topic": "the sky"}]
    batched = tips.run_batch(batch, backend=endpoint, temperature=0)
    for kw, got in zip(batch, batched):
        assert isinstance(got, lang.ProgramState), got
        assert got.text() == tips.run(backend=endpoint, temperature=0, **kw).text()
