"""One request's timing breakdown: when it passed each stage boundary, on the router and on its
workers, and the stages between them (a partition of its end-to-end time).

The router stamps arrival, the tasks sent, the first and the last token it got; the workers
stamp their own boundaries (``ipc.messages.StageStamps``, wall clock) and send them with their
first and last outputs. :meth:`RequestTiming.stages` lays every known boundary on one time line
in the order a request crosses them and names the time between two consecutive ones after the
later one:

========== =====================================================================================
stage      from the previous boundary to
========== =====================================================================================
server     the tasks sent: receive, chat template, tokenize, route (and a lost attempt's retry)
queue      the prefill (or colocated) worker started the prompt's first chunk: the hop there,
           its queue and its grammar compile
prefill    the step that sampled the first token ended
transfer   (disaggregated) the decode worker had the prompt's last KV pages installed
decode     the last token was emitted by the worker that decoded it
deliver    the last token reached the router
respond    (when the answer is built) the answer was ready: detokenize, tool parsing, JSON
========== =====================================================================================

A boundary that is missing (a one-token answer never reaches the decode worker) merges its
stage into the next one. A boundary earlier than the one before it (clocks of two hosts that
disagree) is moved up to it, so every stage is >= 0 and the stages always add up to the time
from arrival to the last boundary. The prefill worker's first token also goes straight to the
router: ``ttft`` (arrival to the first token at the router) is reported beside the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.ipc.messages import StageStamps

STAGES = ("server", "queue", "prefill", "transfer", "decode", "deliver", "respond")
_STAMP_FIELDS = tuple(StageStamps.__struct_fields__)


@dataclass(slots=True)
class RequestTiming:
    """The stage boundaries of one request (one choice), wall-clock seconds (0: not reached).

    ``arrival``: the HTTP request's arrival at the router; ``prepare``: ``(name, start, end)``
    of the chat template's rendering and the tokenizer's run (inside ``server``); ``sent``: its
    current
    attempt's tasks were sent; ``first``, ``last``: its first and last token reached the
    router; ``worker``: the workers' stamps, merged. ``wanted``: the client asked for the
    breakdown (``x-splitserve-timing`` request header).
    """

    arrival: float
    wanted: bool = False
    prepare: list[tuple[str, float, float]] = field(default_factory=list)
    sent: float = 0.0
    first: float = 0.0
    last: float = 0.0
    worker: StageStamps = field(default_factory=StageStamps)

    def fork(self) -> RequestTiming:
        """A fresh timing for another choice of the same HTTP request (same arrival and
        preparation, nothing after)."""
        return RequestTiming(self.arrival, self.wanted, list(self.prepare))

    def merge(self, stamps: StageStamps) -> None:
        """Take every boundary ``stamps`` has reached (a later output's stamps win)."""
        own = self.worker
        for name in _STAMP_FIELDS:
            value = getattr(stamps, name)
            if value:
                setattr(own, name, value)

    def stages(self, end: float = 0.0) -> dict[str, float]:
        """Seconds per stage, in request order, summing to the time from ``arrival`` to the
        last boundary (``end``: the answer was ready; 0: stop at the last token). Stages whose
        boundaries were never reached are left out."""
        w = self.worker
        boundaries = (("server", self.sent), ("queue", w.scheduled), ("prefill", w.first_token),
                      ("transfer", w.kv_ready), ("decode", w.last), ("deliver", self.last),
                      ("respond", end))
        out: dict[str, float] = {}
        prev = self.arrival
        pending = 0.0  # the time of stages whose own boundary is missing
        for name, at in boundaries:
            if not at:
                continue
            at = max(at, prev)
            out[name] = at - prev + pending
            pending = 0.0
            prev = at
        return out

    def summary(self, end: float = 0.0) -> dict[str, object]:
        """The breakdown as the ``x-splitserve-timing`` answer gives it: milliseconds per stage,
        their total, ``ttft_ms`` and the decode ``steps``."""
        stages = self.stages(end)
        total = sum(stages.values())
        out: dict[str, object] = {"stages_ms": {k: round(v * 1e3, 3) for k, v in stages.items()},
                                  "total_ms": round(total * 1e3, 3)}
        if self.first:
            out["ttft_ms"] = round((self.first - self.arrival) * 1e3, 3)
        if self.prepare:
            out["prepare_ms"] = {name: round((b - a) * 1e3, 3) for name, a, b in self.prepare}
        if self.worker.steps:
            out["decode_steps"] = self.worker.steps
        return out


def server_timing_header(stages: dict[str, float]) -> str:
    """``stages`` in the W3C Server-Timing syntax (``queue;dur=1.2, prefill;dur=30.5``, ms), the
    value of the ``x-splitserve-timing`` response header."""
    return ", ".join(f"{name};dur={secs * 1e3:.3f}" for name, secs in stages.items())
