"""A worker's spans (``worker.tracing``) from its stamps, with a recording export in place of
OpenTelemetry: which spans each role makes, under which parent, from when to when; the stage
stamps one engine step sets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.sched.batch import ScheduledBatch
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from splitserve.worker.tracing import WorkerTracer, stamp_step

PARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


@dataclass
class Rec:
    name: str
    parent: Any
    start: float
    end: float = 0.0
    attributes: dict = field(default_factory=dict)
    error: str | None = None


class RecordingExport:
    """``observe.otel.TraceExport``'s span calls, recorded."""

    def __init__(self) -> None:
        self.spans: list[Rec] = []
        self.shut = False

    def start(self, name, parent, start_s, kind="internal", attributes=None) -> Rec:
        rec = Rec(name, parent, start_s, attributes=dict(attributes or {}))
        self.spans.append(rec)
        return rec

    def span(self, name, parent, start_s, end_s, attributes=None, kind="internal") -> Rec:
        rec = self.start(name, parent, start_s, kind, attributes)
        rec.end = end_s
        return rec

    def end(self, span, end_s, error=None) -> None:
        span.end, span.error = end_s, error

    def shutdown(self) -> None:
        self.shut = True


def _req(rid: str) -> Req:
    return Req(rid=rid, input_ids=list(range(40)), sampling=SamplingParams())


def test_a_step_stamps_prompt_and_decode_rows() -> None:
    prompt, decoding = _req("p"), _req("d")
    decoding.stamps.first_token = 1.0
    prompt.output_ids = [7]  # its last chunk sampled the first token
    tracer = WorkerTracer(RecordingExport(), "colocated", "w")
    tracer.begin("p", PARENT)
    stamp_step(ScheduledBatch([decoding, prompt], [1, 40], [0, 1]), 5.0, 6.0, tracer.live)
    assert (prompt.stamps.scheduled, prompt.stamps.first_token) == (5.0, 6.0)
    assert decoding.stamps.steps == 1 and decoding.stamps.scheduled == 0.0
    assert tracer.live["p"].chunks == [(5.0, 6.0, 40)]


def test_colocated_spans_under_the_routers_attempt() -> None:
    export = RecordingExport()
    tracer = WorkerTracer(export, "colocated", "colocated-0")
    tracer.begin("r", PARENT)
    t = tracer.live["r"]
    t.received, t.compiled, t.chunks = 1.0, 1.5, [(2.0, 3.0, 32), (3.0, 4.0, 8)]
    req = _req("r")
    s = req.stamps
    s.scheduled, s.first_token, s.first_step, s.last, s.steps = 2.0, 4.0, 4.5, 9.0, 10
    tracer.end("r", "finished", req)
    tracer.end("r", "finished", req)  # once only
    root = export.spans[0]
    assert (root.name, root.parent, root.start) == ("colocated", PARENT, 1.0)
    assert root.attributes["splitserve.outcome"] == "finished" and root.end >= 9.0
    children = {(x.name, x.start, x.end) for x in export.spans[1:]}
    assert children == {("grammar_compile", 1.0, 1.5), ("queue", 1.0, 2.0),
                        ("prefill_chunk", 2.0, 3.0), ("prefill_chunk", 3.0, 4.0),
                        ("first_decode_step", 4.0, 4.5), ("decode_steps", 4.5, 9.0),
                        ("finish", 9.0, root.end)}
    assert all(x.parent is root for x in export.spans[1:])
    assert tracer.live == {}


def test_decode_spans_and_an_untraced_task() -> None:
    export = RecordingExport()
    tracer = WorkerTracer(export, "decode", "decode-0")
    tracer.begin("plain", None)
    assert tracer.live == {}
    tracer.begin("r", PARENT)
    tracer.live["r"].admitted = 2.0
    req = _req("r")
    req.stamps.decode_received, req.stamps.kv_ready = 1.0, 3.0
    tracer.end("r", "aborted", req, error="client left")
    names = [x.name for x in export.spans]
    assert names == ["decode", "wait_for_pages", "wait_for_kv"]
    assert export.spans[0].error == "client left"


def test_a_bootstrap_before_its_task_starts_the_kv_send() -> None:
    export = RecordingExport()
    tracer = WorkerTracer(export, "prefill", "prefill-0")
    tracer.mark("r", "bootstrap")  # the decode worker's bootstrap came first
    tracer.begin("r", PARENT)
    tracer.end("r", "released")
    kv = [x for x in export.spans if x.name == "kv_send"]
    assert len(kv) == 1 and kv[0].start == tracer_received(export)
    tracer.close()
    assert export.shut and tracer.early_bootstraps == {}


def tracer_received(export: RecordingExport) -> float:
    return export.spans[0].start
