"""The router's owner of a request (``server.disagg_request``) with fake workers and no sockets:
every edge of its transition table, then each behaviour on its own: the dual send, the merge of
prefill's first token with decode's stream, in-flight counts, the retry under a new wire rid,
errors, losses, closes and aborts, and the async reader (``events``) over them."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.ipc.messages import GenerateTask, RequestError, SamplingParams, decode
from splitserve.kv_transfer.session import IllegalTransition
from splitserve.server.disagg_request import DisaggRequest
from splitserve.server.disagg_transitions import DISAGG_TRANSITIONS, DisaggEvent, DisaggState
from splitserve.server.metrics import ServerMetrics
from tests.server.disagg_fakes import (
    FakeWorker,
    disagg_workers,
    make_request,
    output,
    replies,
    token_id,
)

S, E = DisaggState, DisaggEvent


def send_all(req: DisaggRequest) -> None:
    """Start an attempt and send every task, which arrives at once."""
    for worker, frame in req.start():
        assert req.task_out(worker)
        worker.receive(decode(frame))
    req.all_sent()


def drive(state: DisaggState, max_retries: int = 1):
    """A request in ``state`` on 2 prefill + 2 decode fake workers: ``(req, table, workers)``."""
    workers = disagg_workers()
    if state is S.REJECTED:
        for w in workers:
            w.ready = False
    req, _, table = make_request(workers, max_retries=max_retries)
    if state in (S.REJECTED, S.SENDING):
        req.start()
    elif state is not S.NEW:
        send_all(req)
        if state is S.STREAMING:
            req.on_tokens(output(req.wire, 0))
        elif state is S.RETRYING:
            req.on_worker_lost(_decode_of(req), "lost")
        elif state is S.FINISHED:
            req.on_tokens(output(req.wire, 0, finish="length"))
        elif state is S.FAILED:
            req.on_error(RequestError(req.wire, "boom", 500))
        elif state is S.CLOSED:
            req.close()
    assert req.state is state
    replies(req)
    return req, table, workers


def _decode_of(req: DisaggRequest) -> FakeWorker:
    return req._workers[0]


def fire(event: DisaggEvent, req: DisaggRequest, workers: list[FakeWorker]) -> None:
    if event is E.SEND:
        req.start()
    elif event is E.REFUSE:
        for w in workers:
            w.ready = False
        req.start()
    elif event is E.TASK:
        req.task_out(req._workers[0] if req._workers else workers[0])
    elif event is E.SENT:
        req.all_sent()
    elif event is E.TOKENS:
        req.on_tokens(output(req.wire or "r", req.next_index))
    elif event is E.FINISH:
        req.on_tokens(output(req.wire or "r", req.next_index, finish="stop"))
    elif event is E.WORKER_ERROR:
        req.on_error(RequestError(req.wire or "r", "boom", 500))
    elif event in (E.RETRY, E.WORKER_LOST):
        req._max_retries = 1 if event is E.RETRY else 0
        req.on_worker_lost(_decode_of(req), "decode worker d0 lost its connection")
    elif event is E.CLOSE:
        req.close()


def snapshot(req: DisaggRequest, table, workers: list[FakeWorker]) -> tuple:
    return (req.next_index, len(req.replies), dict(table.by_wire),
            [(w.in_flight, sum(w.aborts.values()), len(w.attempted)) for w in workers])


# The methods that fire RETRY / WORKER_LOST pick between them, and do nothing outside a live
# attempt (the worker is none of theirs): those cells are checked on the table itself.
_CHOSEN = (E.RETRY, E.WORKER_LOST)
CASES = [(state, event) for state in DisaggState for event in DisaggEvent]


@pytest.mark.parametrize(("state", "event"), CASES, ids=[f"{s.name}-{e.name}" for s, e in CASES])
def test_every_edge_of_the_table(state, event) -> None:
    """Each method lands where the table says, or raises before any side effect."""
    req, table, workers = drive(state)
    before = snapshot(req, table, workers)
    expected = DISAGG_TRANSITIONS.get((state, event))
    if expected is None:
        if event in _CHOSEN:
            with pytest.raises(IllegalTransition):
                req._next(event)
            return
        with pytest.raises(IllegalTransition):
            fire(event, req, workers)
        assert req.state is state and snapshot(req, table, workers) == before
        return
    fire(event, req, workers)
    assert req.state is expected
    assert (req.wire in table.by_wire) == (expected in (S.SENDING, S.WAITING, S.STREAMING))
    if expected in (S.RETRYING, S.FINISHED, S.FAILED, S.CLOSED, S.REJECTED):
        assert [w.in_flight for w in workers] == [0, 0, 0, 0]
    for w in workers:
        assert all(n <= 1 for n in w.aborts.values()), w.aborts
    if expected is state and event not in (E.TASK, E.TOKENS):
        assert snapshot(req, table, workers) == before  # an ended attempt: nothing happens
    if expected is state and state in (S.RETRYING, S.FINISHED, S.FAILED, S.CLOSED):
        assert snapshot(req, table, workers) == before


def test_worker_loss_outside_a_live_attempt_does_nothing() -> None:
    for state in (S.NEW, S.RETRYING, S.FINISHED, S.FAILED, S.REJECTED, S.CLOSED):
        req, table, workers = drive(state)
        before = snapshot(req, table, workers)
        for w in workers:
            req.on_worker_lost(w, "lost")
        assert req.state is state and snapshot(req, table, workers) == before


def test_dual_send_decode_first_naming_the_prefill_worker() -> None:
    workers = disagg_workers()
    req, _, table = make_request(workers)
    plan = req.start()
    assert req.state is S.SENDING and table.by_wire == {"r": req} and req.wire == "r"
    (d, _), (p, _) = plan
    assert (d.role, p.role) == ("decode", "prefill")
    assert [w.in_flight for w in workers] == [0, 0, 0, 0]  # counted as each task goes
    assert req.task_out(d) and d.in_flight == 1 and p.in_flight == 0
    assert req.task_out(p) and p.in_flight == 1
    req.all_sent()
    assert req.state is S.WAITING


def test_tasks_carry_the_request_and_the_prefill_inbox() -> None:
    workers = disagg_workers()
    req, _, _ = make_request(workers)
    (_, d_frame), (p, p_frame) = req.start()
    d_task, p_task = decode(d_frame), decode(p_frame)
    assert isinstance(d_task, GenerateTask) and isinstance(p_task, GenerateTask)
    assert (d_task.rid, d_task.prefill_addr, d_task.reply_addr) == ("r", p.addr, "tcp://router")
    assert (p_task.rid, p_task.prefill_addr) == ("r", None)
    assert d_task.input_ids == p_task.input_ids == [1, 2, 3]


def test_prefill_first_token_then_decode_stream_in_order() -> None:
    workers = disagg_workers()
    req, _, table = make_request(workers)
    send_all(req)
    d, p = req._workers
    req.on_tokens(output("r", 0))
    assert req.state is S.STREAMING and p.in_flight == 0 and d.in_flight == 1
    assert (p.heard, d.heard) == (1, 0)  # the first token is the prefill worker's sign of life
    req.on_tokens(output("r", 1, count=2))
    req.on_tokens(output("r", 3, finish="length"))
    assert d.heard == 2
    events = replies(req)
    assert [e.token_ids for e in events] == [[token_id(0, 0)], [token_id(0, 1), token_id(0, 2)],
                                             [token_id(0, 3)]]
    assert events[-1].finish_reason == "length" and req.state is S.FINISHED
    assert [w.in_flight for w in workers] == [0, 0, 0, 0]
    assert not any(w.aborts for w in workers)  # finished: each worker freed its own pages
    assert table.by_wire == {}


def test_decode_tokens_ahead_of_the_first_wait_for_it() -> None:
    workers = disagg_workers()
    req, _, _ = make_request(workers)
    send_all(req)
    req.on_tokens(output("r", 2))
    req.on_tokens(output("r", 1))
    assert req.state is S.WAITING and replies(req) == []
    req.on_tokens(output("r", 0))
    req.on_tokens(output("r", 1))  # a duplicate is dropped
    req.on_tokens(output("r", 3, finish="stop"))
    events = replies(req)
    assert [e.token_ids[0] for e in events] == [token_id(0, i) for i in range(4)]
    assert req.state is S.FINISHED


def test_first_token_that_finishes() -> None:
    workers = disagg_workers()
    req, _, _ = make_request(workers)
    send_all(req)
    req.on_tokens(output("r", 0, finish="length"))
    assert req.state is S.FINISHED and [w.in_flight for w in workers] == [0, 0, 0, 0]
    assert not any(w.aborts for w in workers)


def test_colocated_is_one_target() -> None:
    workers = [FakeWorker("colocated", "c0"), FakeWorker("colocated", "c1")]
    req, _, _ = make_request(workers)
    plan = req.start()
    assert [w.name for w, _ in plan] == ["c0"]
    send_all_rest(req, plan)
    req.on_tokens(output("r", 0))
    assert workers[0].in_flight == 1  # no prefill worker to uncount
    req.on_worker_lost(workers[1], "another worker")  # not its worker: nothing
    assert req.state is S.STREAMING
    req.on_tokens(output("r", 1, finish="stop"))
    assert req.state is S.FINISHED and workers[0].in_flight == 0 and workers[0].heard == 2


def send_all_rest(req: DisaggRequest, plan) -> None:
    for w, _ in plan:
        assert req.task_out(w)
    req.all_sent()


def test_a_worker_lost_before_any_token_reruns_under_a_new_wire_rid() -> None:
    workers = disagg_workers()
    req, _, table = make_request(workers)
    send_all(req)
    d, p = req._workers
    d.ready = False
    req.on_worker_lost(d, "decode worker d0 lost its connection")
    assert req.state is S.RETRYING and table.by_wire == {}
    assert (d.aborts["r"], p.aborts["r"]) == (1, 1) and [w.in_flight for w in workers] == [0] * 4
    assert len(replies(req)) == 1  # the reader's cue to start the next attempt
    plan = req.start()
    assert req.wire == "r.retry1" and table.by_wire == {"r.retry1": req}
    assert d not in [w for w, _ in plan]
    send_all_rest(req, plan)
    req.on_tokens(output("r.retry1", 0, attempt=1))
    assert replies(req)[0].token_ids == [token_id(1, 0)]


def test_one_retry_at_most() -> None:
    workers = disagg_workers()
    req, _, _ = make_request(workers)
    send_all(req)
    req.on_worker_lost(req._workers[1], "prefill worker p0 lost its connection")
    replies(req)
    send_all(req)
    d, p = req._workers
    req.on_worker_lost(p, "prefill worker p1 lost its connection")
    [event] = replies(req)
    assert (event.error, event.error_code) == ("prefill worker p1 lost its connection", 503)
    assert req.state is S.FAILED and (d.aborts["r.retry1"], p.aborts["r.retry1"]) == (1, 1)


def test_a_worker_lost_after_a_token_fails_unless_its_part_is_done() -> None:
    workers = disagg_workers()
    req, _, _ = make_request(workers)
    send_all(req)
    d, p = req._workers
    req.on_tokens(output("r", 0))
    req.on_tokens(output("r", 1))  # decode's first: the KV has arrived
    req.on_worker_lost(p, "prefill worker p0 lost its connection")
    assert req.state is S.STREAMING and not p.aborts
    req.on_worker_lost(d, "decode worker d0 lost its connection")
    assert req.state is S.FAILED and replies(req)[-1].error_code == 503
    assert (d.aborts["r"], p.aborts["r"]) == (1, 1) and [w.in_flight for w in workers] == [0] * 4


def test_prefill_lost_after_only_the_first_token_fails_it() -> None:
    workers = disagg_workers()
    req, _, _ = make_request(workers)
    send_all(req)
    req.on_tokens(output("r", 0))
    req.on_worker_lost(req._workers[1], "prefill worker p0 lost its connection")
    assert req.state is S.FAILED  # a token was delivered: no retry


@pytest.mark.parametrize("tokens", [0, 2])
def test_a_worker_error_fails_it_and_aborts_both(tokens: int) -> None:
    """A RequestError names the rid, not its sender: either worker's ends the request."""
    workers = disagg_workers()
    req, _, table = make_request(workers)
    send_all(req)
    for i in range(tokens):
        req.on_tokens(output("r", i))
    replies(req)
    req.on_error(RequestError("r", "grammar failed", 400))
    [event] = replies(req)
    assert (event.error, event.error_code) == ("grammar failed", 400)
    assert req.state is S.FAILED and table.by_wire == {}
    assert [w.aborts["r"] for w in req._workers] == [1, 1]


def test_close_mid_stream_aborts_each_worker_once() -> None:
    workers = disagg_workers()
    req, _, table = make_request(workers)
    send_all(req)
    req.on_tokens(output("r", 0))
    replies(req)
    req.close()
    req.close()
    assert req.state is S.CLOSED and table.by_wire == {}
    assert [w.aborts["r"] for w in req._workers] == [1, 1]
    assert [w.in_flight for w in workers] == [0] * 4
    assert len(replies(req)) == 1  # the end of a reader that still waits


def test_abort_of_a_rid_not_in_flight_sends_nothing() -> None:
    workers = disagg_workers()
    req, _, table = make_request(workers)
    send_all(req)
    table.abort("r")  # ``events`` enters it in by_rid; no reader ran here
    table.abort("someone-else")
    assert req.state is S.WAITING and not any(w.aborts for w in workers)


def test_refused_requests_count_nothing() -> None:
    workers = disagg_workers()
    for w in workers:
        if w.role == "decode":
            w.ready = False
    req, _, _ = make_request(workers)
    event = req.start()
    assert (event.error_code, req.state) == (503, S.REJECTED)
    workers = disagg_workers()
    bad, _, table = make_request(workers, sampling=SamplingParams(seed=2**70))
    event = bad.start()
    assert event.error_code == 400 and "out of range" in event.error and bad.state is S.REJECTED
    assert table.by_wire == {} and [w.in_flight for w in workers] == [0] * 4


# ---- the reader: events() ---------------------------------------------------------------------


async def _collect(req: DisaggRequest, inject) -> list:
    """Read ``req.events()`` while ``inject(req)`` plays the workers' part."""
    got = []
    reader = asyncio.ensure_future(_read(req, got))
    await inject(req)
    await reader
    return got


async def _read(req: DisaggRequest, got: list) -> None:
    async for ev in req.events():
        got.append(ev)


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0)


def test_events_runs_a_retry_and_counts_it() -> None:
    metrics = ServerMetrics()
    workers = disagg_workers()
    req, _, table = make_request(workers, metrics=metrics)

    async def workers_part(req) -> None:
        await _until(lambda: req.state is S.WAITING)
        req.on_worker_lost(req._workers[0], "decode worker d0 lost its connection")
        await _until(lambda: req.state is S.WAITING)
        assert req.wire == "r.retry1" and table.by_rid == {"r": req}
        req.on_tokens(output(req.wire, 1, attempt=1))
        req.on_tokens(output(req.wire, 0, attempt=1))
        req.on_tokens(output(req.wire, 2, finish="length", attempt=1))

    got = asyncio.run(_collect(req, workers_part))
    assert [e.token_ids for e in got] == [[token_id(1, i)] for i in range(3)]
    assert got[-1].finish_reason == "length" and table.by_rid == {} and table.by_wire == {}
    assert metrics.registry.get_sample_value("splitserve_request_retries_total") == 1
    assert metrics.registry.get_sample_value("splitserve_requests_total",
                                             {"outcome": "finished"}) == 1
    assert [w.in_flight for w in workers] == [0] * 4


def test_events_yields_a_refusal_once() -> None:
    metrics = ServerMetrics()
    req, _, table = make_request([], metrics=metrics)

    async def nothing(req) -> None:
        return None

    got = asyncio.run(_collect(req, nothing))
    assert [(e.error_code, e.error) for e in got] == [(503, "no healthy prefill/decode worker")]
    assert metrics.registry.get_sample_value("splitserve_requests_total",
                                             {"outcome": "rejected"}) == 1
    assert table.by_rid == {}


def test_a_failed_send_raises_and_releases_what_it_counted() -> None:
    workers = disagg_workers()
    req, port, _ = make_request(workers, auto_send=False)

    async def run() -> None:
        reader = asyncio.ensure_future(_read(req, []))
        await _until(lambda: port.sends)
        port.sends[0].sent.set_exception(ConnectionError("link broke"))
        with pytest.raises(ConnectionError):
            await reader

    asyncio.run(run())
    d, p = req._workers
    assert req.state is S.CLOSED and [w.in_flight for w in workers] == [0] * 4
    assert (d.attempted, p.attempted) == (["r"], [])  # the prefill task was never sent
    assert (d.aborts["r"], p.aborts["r"]) == (1, 0)


def test_cancelling_the_reader_closes_the_request() -> None:
    workers = disagg_workers()
    req, _, table = make_request(workers)

    async def run() -> None:
        got = []
        reader = asyncio.ensure_future(_read(req, got))
        await _until(lambda: req.state is S.WAITING)
        req.on_tokens(output("r", 0))
        await _until(lambda: got)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(run())
    assert req.state is S.CLOSED and table.by_rid == {} and table.by_wire == {}
    assert [w.aborts["r"] for w in req._workers] == [1, 1]
    assert [w.in_flight for w in workers] == [0] * 4


def test_an_abort_from_elsewhere_ends_the_stream_after_what_came() -> None:
    workers = disagg_workers()
    req, _, table = make_request(workers)

    async def workers_part(req) -> None:
        await _until(lambda: req.state is S.WAITING)
        req.on_tokens(output("r", 0))
        table.abort("r")
        table.abort("r")  # once is enough: nothing more

    got = asyncio.run(_collect(req, workers_part))
    assert [e.token_ids for e in got] == [[token_id(0, 0)]]
    assert [w.aborts["r"] for w in req._workers] == [1, 1]


def test_an_abort_while_a_retry_waits_for_an_old_send_ends_the_stream() -> None:
    """The retry's cue is queued while the reader still awaits the old attempt's send; an
    abort then closes the request: the reader must end, not start the next attempt."""
    workers = disagg_workers()
    req, port, table = make_request(workers, auto_send=False)

    async def run() -> list:
        got = []
        reader = asyncio.ensure_future(_read(req, got))
        await _until(lambda: port.sends)
        req.on_worker_lost(req._workers[1], "prefill worker p0 lost its connection")
        table.abort("r")
        assert req.state is S.CLOSED
        port.sends[0].sent.set_result(None)
        await reader
        return got

    assert asyncio.run(run()) == []
    assert req.num_attempts == 1 and [w.in_flight for w in workers] == [0] * 4
    assert req._workers[0].aborts["r"] == 1
