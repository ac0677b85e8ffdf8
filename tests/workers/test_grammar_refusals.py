"""How a worker answers a request whose constraint could not be compiled: the constraint's
fault is a 400 with the compiler's message; no compile process to run it in (a full queue, or a
process that would not start) is a 503 (the API server adds ``Retry-After``); anything else is
ours, a 500. The service here is a stand-in that hands back a finished future: the compile
pool's own behaviour is ``tests/grammar/test_compile_isolation.py``'s."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from splitserve.engine.grammar.base import GrammarError
from splitserve.engine.grammar.compile_pool import CompileBusy, CompileUnavailable
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import Constraint, SamplingParams
from splitserve.worker.grammars import WorkerGrammars


class _FailingService:
    """A grammar service whose every compile has already failed with ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def submit(self, kind, text, options) -> Future:
        future: Future = Future()
        future.set_exception(self.error)
        return future


@pytest.mark.parametrize(("error", "code", "says"), [
    (GrammarError("cannot compile json_schema constraint: bad"), 400, "bad"),
    (CompileBusy("16 grammar compiles are already waiting"), 503, "already waiting"),
    (CompileUnavailable("the grammar compile process did not start: TimeoutError('not "
                        "ready 180s after it was started (killed)')"), 503, "did not start"),
    (RuntimeError("a backend bug"), 500, "a backend bug"),
])
def test_a_failed_compile_is_answered_with_whose_fault_it_was(error, code, says) -> None:
    grammars = WorkerGrammars(_FailingService(error), vocab_size=8, stop_token_ids=[0],
                              tokenizer=None, jump_forward=False)
    sampling = SamplingParams(max_new_tokens=4, constraint=Constraint("json_schema", "{}"))
    grammars.submit(Req(rid="r1", input_ids=[1, 2], sampling=sampling))
    [done] = grammars.poll()
    assert done.req.rid == "r1" and done.code == code and says in done.error, done
    assert not grammars.is_pending("r1")
