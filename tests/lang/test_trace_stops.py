"""The trace rule without a model: tracing stops at the first data-dependent operation, keeps
what it recorded, and never fails a program; ``run_batch`` then equals ``run``."""

from __future__ import annotations

import pytest

from splitserve import lang
from tests.lang.fake_backend import FakeBackend
from tests.lang.python_ops import OPS, PREFIX, ops_program


@pytest.mark.parametrize("op", sorted(OPS))
def test_trace_stops_at_the_operation_and_keeps_the_prefix(op: str) -> None:
    tr = ops_program.trace(op=op)
    assert not tr.complete and tr.stopped_at
    assert [type(n).__name__ for n in tr.nodes] == ["ConstantText", "Gen", "ConstantText", "Gen"]
    assert tr.constant_prefix()[0].text.startswith(PREFIX)


def test_run_batch_equals_run_for_every_operation() -> None:
    backend = FakeBackend(reply=lambda text: "7")
    batch = [{"op": op} for op in OPS]
    out = ops_program.run_batch(batch, backend=backend, num_threads=4)
    for kw, got in zip(batch, out):
        assert isinstance(got, lang.ProgramState), got
        want = ops_program.run(backend=backend, **kw)
        assert got.text() == want.text() and got.variables() == want.variables()
        assert f"So: {OPS[kw['op']]('7', 42)}\n" in got.text()
    # The shared prefix (all text before the first gen) was warmed once, before the items.
    assert backend.prefills == [PREFIX + "Q: How many eyes has a cat?\nA: "]


def test_a_program_catching_exceptions_cannot_swallow_the_stop() -> None:
    @lang.function
    def guarded(s):
        s += "n=" + lang.gen("n", dtype=int)
        try:
            big = s["n"] > 10
        except Exception:  # noqa: BLE001 - what a user program may do
            big = None
        s += "checked" if big is None else "ran"

    tr = guarded.trace()
    assert not tr.complete and "'n'" in tr.stopped_at
    assert [type(n).__name__ for n in tr.nodes] == ["ConstantText", "Gen"]


def test_state_reads_stop_the_trace() -> None:
    for read in (lambda s: s.text(), lambda s: s.messages(), lambda s: "x" in s,
                 lambda s: s.tool_calls("x"), lambda s: s.meta("x")):
        tr = lang.function(lambda s, read=read: (s.__iadd__("a" + lang.gen("x")), read(s))
                           ).trace()
        assert not tr.complete and len(tr.nodes) == 2, tr.stopped_at


def test_program_error_before_any_read_is_raised_by_trace_and_reported_by_run_batch() -> None:
    @lang.function
    def strict(s, n):
        if n < 0:
            raise ValueError("n must be >= 0")
        s += "x" * 40 + str(n) + lang.gen("a")

    with pytest.raises(ValueError, match="n must be"):
        strict.trace(n=-1)
    backend = FakeBackend()
    out = strict.run_batch([{"n": 1}, {"n": -1}, {"n": 2}], backend=backend)
    assert isinstance(out[1], lang.ProgramError) and "n must be" in str(out[1])
    assert all(isinstance(x, lang.ProgramState) for x in (out[0], out[2]))
    assert backend.prefills == ["x" * 40]  # the good items still shared their prefix


def test_warm_up_failure_does_not_fail_the_batch() -> None:
    backend = FakeBackend(fail_on="x" * 40)
    prog = lang.function(lambda s, q: s.__iadd__("x" * 40 + q + lang.gen("a")))
    out = prog.run_batch([{"q": "a"}, {"q": "b"}], backend=backend)
    assert all(isinstance(x, lang.ProgramError) and "fake failure" in str(x) for x in out)
