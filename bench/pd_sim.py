"""A discrete-event model of a splitserve cluster, for sizing prefill and decode pools (DistServe,
Zhong et al., OSDI 2024: place prefill and decode to maximise goodput under TTFT and ITL SLOs).

It replays a list of requests (arrival time, prompt length, output length) through ``P`` prefill
workers and ``D`` decode workers (or ``C`` colocated workers) that behave as the engine does:

* a prefill worker runs steps back to back while it has prompts, each step taking prompt chunks
  first come, first served, up to ``max_batch_tokens``; a prompt's first token comes at the end
  of the step that finishes it (TTFT), and its KV reaches the least loaded decode worker after
  ``transfer_s_per_token`` per prompt token;
* a decode worker runs one decode step over all its running requests (up to ``max_running``),
  each getting one token at the step's end;
* a colocated worker runs both in one step: decodes first, then prompt chunks in the rest of the
  budget (chunked prefill as in Sarathi-Serve and the engine's scheduler).

Step times come from a :class:`StepModel` fitted to steps measured on the real engine
(``bench/pd_profile.py``). What a real cluster spends outside the engine's steps (HTTP, the
router, ZeroMQ hops, the KV handshake, detokenizing and streaming each token, the worker's own
Python around a step) is a :class:`ServingOverhead`, calibrated on closed-loop runs of the real
server (``plan_pd.py calibrate``); without it the model predicts forward steps only, which
under-predicts latency at light load. KV pool limits are not modelled (the default pool holds far more than
these workloads keep in flight). Outputs are ``serving_metrics.RequestOutput`` records, so
goodput is computed exactly as ``bench/serving.py`` computes it for a real run.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from serving_metrics import RequestOutput


@dataclass(frozen=True, slots=True)
class StepModel:
    """Seconds of one engine step on one worker (fitted, ``pd_profile.fit``):

    ``decode(rows, ctx) = d0 + d_row * rows + d_ctx * ctx`` for ``rows`` decoding sequences
    holding ``ctx`` tokens of KV in all; ``prefill(tokens, pairs) = p0 + p_tok * tokens +
    p_pair * pairs`` for ``tokens`` new prompt tokens whose attention covers ``pairs``
    query-key pairs. A mixed step costs the decode part plus the prefill part without its
    intercept (one pass over the weights)."""

    d0: float
    d_row: float
    d_ctx: float
    p0: float
    p_tok: float
    p_pair: float
    threads: int = 1

    def decode(self, rows: int, ctx: int) -> float:
        return self.d0 + self.d_row * rows + self.d_ctx * ctx

    def prefill(self, tokens: int, pairs: float) -> float:
        return self.p0 + self.p_tok * tokens + self.p_pair * pairs

    def mixed(self, rows: int, ctx: int, tokens: int, pairs: float) -> float:
        if not rows:
            return self.prefill(tokens, pairs)
        if not tokens:
            return self.decode(rows, ctx)
        return self.decode(rows, ctx) + self.prefill(tokens, pairs) - self.p0


@dataclass(frozen=True, slots=True)
class ServingOverhead:
    """Seconds a real cluster spends outside the engine's steps, measured on this machine
    (``plan_pd.calibrate``; zero: forward steps only).

    ``request_s``: once per request, between the client's send and its prompt entering a
    worker's queue plus its first token's way back (HTTP, the router, ZeroMQ, the handshake).
    ``step_s``: added to every step (the worker's Python around the forward pass, and the
    server's per-step work where it shares the worker's cores). ``token_s``: added to a step per
    token it emits (detokenizing and streaming each one, where the server shares the cores).
    ``itl_tail_s``: added to the reported p99 ITL only (``plan_pd.simulate_run``): the real
    gaps' tail beyond the simulated one (preemption by the server and client sharing the cores,
    timer and scheduler jitter), which mean per-step terms do not produce; SLO attainment and
    goodput do not use it."""

    request_s: float = 0.0
    step_s: float = 0.0
    token_s: float = 0.0
    itl_tail_s: float = 0.0


NO_OVERHEAD = ServingOverhead()  # forward steps only


@dataclass(slots=True)
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int
    prefilled: int = 0
    generated: int = 0
    last_token: float = 0.0
    out: RequestOutput = field(default_factory=lambda: RequestOutput("sim", 0))


@dataclass(slots=True)
class _Worker:
    kind: str  # "prefill" | "decode" | "colocated"
    model: StepModel
    queue: deque = field(default_factory=deque)  # prompts not fully prefilled
    running: list = field(default_factory=list)  # decoding
    busy_until: float = 0.0
    stepping: bool = False

    @property
    def load(self) -> int:
        return len(self.running) + len(self.queue)


@dataclass(frozen=True, slots=True)
class ClusterShape:
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    max_batch_tokens: int = 2048
    max_running: int = 64
    transfer_s_per_token: float = 0.0
    # Cores the workers share (0: each has its own). When the busy workers' threads exceed
    # them, a step starting then takes (busy threads / cores) times longer: time-sharing, as
    # three one-thread workers on two cores get (2P1D on this machine).
    cores: int = 0

    def describe(self) -> str:
        if self.num_colocated:
            return f"{self.num_colocated} colocated"
        return f"{self.num_prefill}P{self.num_decode}D"


def simulate(
    requests: list[tuple[float, int, int]],
    shape: ClusterShape,
    prefill_model: StepModel,
    decode_model: StepModel,
    overhead: ServingOverhead = NO_OVERHEAD,
    concurrency: int | None = None,
) -> list[RequestOutput]:
    """Run ``requests`` (arrival s, prompt tokens, output tokens) through ``shape``; colocated
    workers use ``decode_model`` for both parts. With ``concurrency`` the load is a closed loop
    as ``bench/serving.py --concurrency`` runs it: the arrival times are ignored, the first
    ``concurrency`` requests start at 0 and each finished one starts the next. Returns one
    record per request, in order."""
    if shape.num_colocated:
        workers = [_Worker("colocated", decode_model) for _ in range(shape.num_colocated)]
        prefills, decodes = workers, workers
    else:
        prefills = [_Worker("prefill", prefill_model) for _ in range(shape.num_prefill)]
        decodes = [_Worker("decode", decode_model) for _ in range(shape.num_decode)]
        workers = prefills + decodes
    reqs = [SimRequest(a, p, o, out=RequestOutput("sim", p, start=a)) for a, p, o in requests]
    events: list[tuple[float, int, str, object]] = []
    seq = itertools.count()
    pending = deque(reqs)

    def send(r: SimRequest, now: float) -> None:
        r.arrival = r.out.start = now
        # Half the per-request overhead before the queue, half on the first token's way back:
        # which half is which does not change TTFT, only when the worker sees the prompt.
        heapq.heappush(events, (now + overhead.request_s / 2, next(seq), "arrive", r))

    if concurrency:
        for _ in range(min(concurrency, len(pending))):
            send(pending.popleft(), 0.0)
    else:
        for r in reqs:
            send(r, r.arrival)

    def start_step(w: _Worker, now: float) -> None:
        if w.stepping or not (w.queue or w.running):
            return
        rows = w.running[: shape.max_running]
        budget = shape.max_batch_tokens - len(rows)
        chunks: list[tuple[SimRequest, int]] = []
        for r in w.queue:
            if budget <= 0:
                break
            n = min(r.prompt_len - r.prefilled, budget)
            chunks.append((r, n))
            budget -= n
        ctx = sum(r.prompt_len + r.generated for r in rows)
        tokens = sum(n for _, n in chunks)
        pairs = sum(n * (r.prefilled + n / 2) for r, n in chunks)
        emitted = len(rows) + sum(r.prefilled + n == r.prompt_len for r, n in chunks)
        w.stepping = True
        share = 1.0
        if shape.cores:
            busy = sum(x.model.threads for x in workers if x.stepping)
            share = max(1.0, busy / shape.cores)
        end = now + share * (w.model.mixed(len(rows), ctx, tokens, pairs) + overhead.step_s
                             + overhead.token_s * emitted)
        heapq.heappush(events, (end, next(seq), "step", (w, list(rows), chunks)))

    def finish(r: SimRequest, now: float) -> None:
        r.out.latency = now + overhead.request_s / 2 - r.arrival
        r.out.output_tokens = r.generated
        if concurrency and pending:
            send(pending.popleft(), now + overhead.request_s / 2)

    def to_decode(r: SimRequest, now: float) -> None:
        d = min(decodes, key=lambda w: w.load)
        heapq.heappush(events, (now + shape.transfer_s_per_token * r.prompt_len, next(seq),
                                "kv", (d, r)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            r = payload
            # Prompt work queued first (the router balances prefill load), then running rows.
            w = min(prefills, key=lambda w: (sum(q.prompt_len - q.prefilled for q in w.queue),
                                             len(w.running)))
            w.queue.append(r)
            start_step(w, now)
        elif kind == "kv":
            d, r = payload
            d.running.append(r)
            start_step(d, now)
        else:
            w, rows, chunks = payload
            w.stepping = False
            for r in rows:
                r.generated += 1
                r.out.itls.append(now - r.last_token)
                r.last_token = now
            for r, n in chunks:
                r.prefilled += n
                if r.prefilled < r.prompt_len:
                    continue
                w.queue.remove(r)
                r.generated, r.last_token = 1, now
                r.out.ttft = now + overhead.request_s / 2 - r.arrival
                if r.output_len <= 1:
                    finish(r, now)
                elif w.kind == "colocated":
                    w.running.append(r)
                else:
                    to_decode(r, now)
            for r in [r for r in w.running if r.generated >= r.output_len]:
                w.running.remove(r)
                finish(r, now)
            start_step(w, now)
    return [r.out for r in reqs]
