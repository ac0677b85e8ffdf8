"""Workers report the grammar compile they sample under: the first ``TokenOutput`` a worker sends
for a ``json_schema`` request names the backend that compiled it and what that backend ignores
(``TokenOutput.grammar_backend``, ``grammar_ignored``), for the API server's partial header and
violation metric. Real workers in-process (the default model, compiles on threads)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from splitserve.ipc.messages import (
    Constraint,
    GenerateTask,
    SamplingParams,
    TokenBatch,
    TokenOutput,
)
from splitserve.ipc.sockets import Inbox, free_tcp_addr
from tests.kv_transfer.workers import PROMPT, finished, make_worker, run_until

# llguidance enforces the whole of it: it compiles.
SOUND = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
         "required": ["n"]}
# llguidance refuses uniqueItems (a compile error); xgrammar, next in the chain, compiles it
# and ignores the keyword.
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


def _task(server: Inbox, rid: str, schema: dict) -> GenerateTask:
    sampling = SamplingParams(max_new_tokens=4, temperature=0,
                              constraint=Constraint("json_schema", json.dumps(schema)))
    return GenerateTask(rid=rid, input_ids=PROMPT, reply_addr=server.addr, sampling=sampling)


def _outputs(got: list, rid: str) -> list[TokenOutput]:
    outs = [o for m in got if isinstance(m, TokenBatch) for o in m.outputs if o.rid == rid]
    return sorted(outs, key=lambda o: o.index)


def _reports(outs: list[TokenOutput]) -> list[tuple[int, str, list[str]]]:
    return [(o.index, o.grammar_backend, o.grammar_ignored) for o in outs if o.grammar_backend]


def _worker(model_path: Path, role: str, server: Inbox):
    return make_worker(model_path, role, server.addr, "zmq", grammar_compile_procs=0)


def _close(*workers) -> None:
    """What ``Worker.serve_forever`` closes on its way out (a failed assertion's traceback
    keeps the workers alive: their sockets must not outlive the test)."""
    for w in workers:
        w.close()


@pytest.mark.parametrize(("schema", "backend", "ignored"), [
    (SOUND, "llguidance", []),
    (UNIQUE, "xgrammar", ["uniqueItems at /"]),
])
def test_colocated_first_output_names_the_backend_that_compiled(
        ctx, model_path, schema, backend, ignored) -> None:
    server = Inbox(ctx, free_tcp_addr())
    worker = _worker(model_path, "colocated", server)
    try:
        worker.dispatch(_task(server, "r1", schema), [])
        outs = _outputs(run_until([worker], server, finished), "r1")
    finally:
        _close(worker)
        server.close()
    assert outs[0].index == 0
    assert _reports(outs) == [(0, backend, ignored)]  # on the first output only


def test_disaggregated_each_worker_reports_its_own_compile(ctx, model_path) -> None:
    """The prefill worker's report rides on the first token (index 0); the decode worker
    compiles the same plan itself and reports on its first own output."""
    server = Inbox(ctx, free_tcp_addr())
    prefill = _worker(model_path, "prefill", server)
    decode = _worker(model_path, "decode", server)
    try:
        task = _task(server, "r1", UNIQUE)
        prefill.dispatch(task, [])
        decode.dispatch(msgspec.structs.replace(task, prefill_addr=prefill.config.addr), [])
        outs = _outputs(run_until([prefill, decode], server, finished), "r1")
    finally:
        _close(prefill, decode)
        server.close()
    assert len(outs) >= 2, outs
    assert _reports(outs) == [(0, "xgrammar", ["uniqueItems at /"]),
                              (outs[1].index, "xgrammar", ["uniqueItems at /"])]
