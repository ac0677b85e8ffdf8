"""A worker's spans of the requests the router traces (their ``GenerateTask.traceparent``).

The loop records plain numbers while a traced request is here (:class:`ReqTrace`: when its
task came, each prompt chunk, its bootstrap, its pages reserved) beside the stage stamps every
request carries (``Req.stamps``); when the request leaves this worker, :meth:`WorkerTracer.end`
turns them into spans under the router's attempt span, with their real start and end times:

========================= ===================================================================
prefill worker            ``prefill`` (task in -> pages sent and freed), children:
                          ``grammar_compile``, ``queue``, ``prefill_chunk`` (one per chunk,
                          ``tokens``), ``kv_send`` (bootstrap -> sent)
decode worker             ``decode`` (task in -> end), children: ``grammar_compile``,
                          ``wait_for_pages`` (queued until its pages were reserved),
                          ``wait_for_kv`` (reserved -> last pages installed),
                          ``first_decode_step``, ``decode_steps`` (``steps``), ``finish``
colocated worker          ``colocated``: the prompt's spans and the decode ones
========================= ===================================================================

Nothing here runs for a request that is not traced, and the OpenTelemetry SDK is imported only
where tracing is on (``observe.otel``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from splitserve.ipc.messages import StageStamps

if TYPE_CHECKING:
    from splitserve.engine.sched.batch import ScheduledBatch
    from splitserve.engine.sched.request import Req
    from splitserve.observe.otel import TraceExport

logger = logging.getLogger(__name__)

STALE_S = 600.0  # a traced request still here after this long is ended as "stale" (a leak guard)


class ReqTrace:
    """What a traced request did here besides its stamps: its router's ``traceparent``, when
    its task came (wall seconds), its prompt chunks ``(start, end, tokens)``, when its grammar
    compiled, when the decode worker's bootstrap came (prefill) or its pages were reserved
    (decode). ``stamps`` is the request's own ``Req.stamps`` once the loop saw it."""

    __slots__ = ("admitted", "bootstrap", "chunks", "compiled", "received", "stamps",
                 "traceparent")

    def __init__(self, traceparent: str, received: float) -> None:
        self.traceparent = traceparent
        self.received = received
        self.chunks: list[tuple[float, float, int]] = []
        self.compiled = 0.0
        self.bootstrap = 0.0
        self.admitted = 0.0
        self.stamps: StageStamps | None = None


def stamp_step(batch: ScheduledBatch, start: float, end: float,
               traces: dict[str, ReqTrace] | None) -> None:
    """Stamp the stage boundaries one engine step (``start``..``end``, wall seconds) crossed:
    a prompt's first chunk started (``scheduled``), its first token sampled (``first_token``),
    a decode step taken (``steps``); and each traced prompt chunk (``traces``: the traced
    requests by rid, None when there are none)."""
    for req, n in zip(batch.reqs, batch.chunk_lens):
        s = req.stamps
        if s.first_token or s.kv_ready:
            s.steps += 1
            continue
        if not s.scheduled:
            s.scheduled = start
        if req.output_ids:
            s.first_token = end
        if traces is not None:
            t = traces.get(req.rid)
            if t is not None:
                t.chunks.append((start, end, n))
                t.stamps = s


class WorkerTracer:
    """The traced requests of one worker and the spans they become.

    Args:
        export: where spans go (``observe.otel.TraceExport``).
        role: the worker's role name; ``worker_id``: its id (span attributes).
    """

    def __init__(self, export: TraceExport, role: str, worker_id: str) -> None:
        self.export = export
        self.role = role
        self.worker_id = worker_id
        self.live: dict[str, ReqTrace] = {}
        # Bootstraps that came before their task (the decode worker's task goes first).
        self.early_bootstraps: dict[str, float] = {}

    def begin(self, rid: str, traceparent: str | None) -> None:
        """A task came: trace it if its router traces it."""
        bootstrap = self.early_bootstraps.pop(rid, 0.0)
        if traceparent:
            t = self.live[rid] = ReqTrace(traceparent, time.time())
            t.bootstrap = bootstrap

    def seen(self, req: Req) -> None:
        """``req`` exists here now: remember its stamps (for an end that names only its rid)."""
        t = self.live.get(req.rid)
        if t is not None:
            t.stamps = req.stamps

    def mark(self, rid: str, what: str) -> None:
        """``rid`` reached ``what`` now: ``compiled``, ``bootstrap`` or ``admitted``."""
        t = self.live.get(rid)
        if t is None:
            if what == "bootstrap":  # its task may still come
                self.early_bootstraps[rid] = time.time()
        elif not getattr(t, what):
            setattr(t, what, time.time())

    def end(self, rid: str, outcome: str, req: Req | None = None, error: str | None = None,
            ) -> None:
        """``rid`` left this worker (``outcome``: finished, sent, aborted, failed...): export
        its spans. Once per request; unknown rids are ignored."""
        t = self.live.pop(rid, None)
        if t is None:
            return
        stamps = req.stamps if req is not None else t.stamps or StageStamps()
        try:
            self._spans(rid, t, stamps, outcome, error, time.time())
        except Exception:  # a tracing bug must not take the worker down
            logger.exception("spans of %s not exported", rid)

    def sweep(self, now_wall: float) -> None:
        """End the traces of requests here for longer than :data:`STALE_S` (a leak guard)."""
        for rid in [r for r, t in self.live.items() if now_wall - t.received > STALE_S]:
            self.end(rid, "stale")
        for rid in [r for r, t in self.early_bootstraps.items() if now_wall - t > STALE_S]:
            del self.early_bootstraps[rid]

    def close(self) -> None:
        """End what is still live and export everything."""
        for rid in list(self.live):
            self.end(rid, "worker_stopped")
        self.export.shutdown()

    # ---- spans ----------------------------------------------------------------------------------

    def _spans(self, rid: str, t: ReqTrace, s: StageStamps, outcome: str, error: str | None,
               end: float) -> None:
        x = self.export
        attrs = {"splitserve.rid": rid, "splitserve.worker_id": self.worker_id,
                 "splitserve.outcome": outcome}
        root = x.start(self.role, t.traceparent, t.received, "server", attrs)
        if t.compiled:
            x.span("grammar_compile", root, t.received, t.compiled)
        if self.role == "decode":
            received = s.decode_received or t.received
            admitted = t.admitted
            if admitted:
                x.span("wait_for_pages", root, received, admitted)
            if admitted and s.kv_ready:
                x.span("wait_for_kv", root, admitted, s.kv_ready)
            self._decode_spans(root, s.kv_ready, s, end)
        else:
            if s.scheduled:
                x.span("queue", root, t.received, s.scheduled)
            for i, (c0, c1, n) in enumerate(t.chunks):
                x.span("prefill_chunk", root, c0, c1, {"splitserve.chunk": i,
                                                       "splitserve.tokens": n})
            if self.role == "prefill":
                if t.bootstrap:
                    x.span("kv_send", root, max(t.bootstrap, t.received), end)
            else:
                self._decode_spans(root, s.first_token, s, end)
        x.end(root, end, error)

    def _decode_spans(self, root: Any, ready: float, s: StageStamps, end: float) -> None:
        """``first_decode_step`` (the KV ready, or the first token, to the first decode step),
        ``decode_steps`` (to the last token) and ``finish`` (to the request's end here)."""
        x = self.export
        if ready and s.first_step:
            x.span("first_decode_step", root, ready, s.first_step)
        if s.first_step and s.last:
            x.span("decode_steps", root, s.first_step, s.last, {"splitserve.steps": s.steps})
        if s.last:
            x.span("finish", root, s.last, end)
