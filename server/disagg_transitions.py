"""The router's side of one request as a transition table: every ``(state, event) -> next state``
that a :class:`~splitserve.server.disagg_request.DisaggRequest` allows; any other pair raises
:class:`~splitserve.kv_transfer.session.IllegalTransition` (the same error the KV transfer
sessions raise). An edge back to the same state is an event that changes nothing there: the
attempt it belongs to has ended (a task not sent, a ``SENT`` after the tokens came) or the
request has (a second close).

One request may take several attempts (a worker lost before any token: re-run once on other
workers under a new wire rid); an attempt is the time from ``SEND`` to the edge that leaves
``SENDING``/``WAITING``/``STREAMING``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class DisaggState(enum.Enum):
    """Where one request stands, as the router sees it.

    =========== ======================================================= =======================
    state       meaning                                                 exits
    =========== ======================================================= =======================
    NEW         made; no worker picked yet                              SENDING, REJECTED,
                                                                        CLOSED
    SENDING     an attempt's workers picked and its wire rid routed;    WAITING, STREAMING,
                its tasks go out one by one, each worker counted in     FINISHED, FAILED,
                flight as its task goes                                 RETRYING, CLOSED
    WAITING     every task of the attempt sent; no token delivered yet  STREAMING, FINISHED,
                                                                        FAILED, RETRYING,
                                                                        CLOSED
    STREAMING   tokens delivered in output order; the prefill worker    FINISHED, FAILED,
                no longer counted in flight                             CLOSED
    RETRYING    a worker was lost before any token: the attempt's       SENDING, REJECTED,
                workers uncounted and aborted, its wire rid unrouted;   CLOSED
                the next attempt starts when the reader asks
    =========== ======================================================= =======================

    Terminal: FINISHED (the last token delivered; every worker uncounted, none aborted: each
    freed its pages itself), FAILED (an error delivered: a worker's ``RequestError`` or a
    worker lost; every worker uncounted and aborted), REJECTED (refused before any worker heard
    of it: no healthy worker, overloaded, a value the wire cannot carry; nothing counted) and
    CLOSED (the reader left, a send raised, or ``abort``; every worker uncounted and aborted).
    """

    NEW = "new"
    SENDING = "sending"
    WAITING = "waiting"
    STREAMING = "streaming"
    RETRYING = "retrying"
    FINISHED = "finished"
    FAILED = "failed"
    REJECTED = "rejected"
    CLOSED = "closed"

    @property
    def is_terminal(self) -> bool:
        """FINISHED, FAILED, REJECTED or CLOSED: nothing more happens to the request."""
        return self in _TERMINAL


class DisaggEvent(enum.Enum):
    """What can happen to a request on the router (the value says what)."""

    SEND = "an attempt starts: its workers picked, its tasks encoded"
    REFUSE = "an attempt is refused: no healthy worker, one full, or an unencodable value"
    TASK = "one task of the attempt is about to go out"
    SENT = "the attempt's sending is over"
    TOKENS = "tokens delivered in order, not the last"
    FINISH = "the last token delivered in order"
    WORKER_ERROR = "RequestError from a worker of the attempt"
    RETRY = "a worker it depends on was lost before any token, a retry left"
    WORKER_LOST = "a worker it depends on was lost, no retry"
    CLOSE = "the reader left, a send raised, or abort"


S, E = DisaggState, DisaggEvent
_TERMINAL = frozenset({S.FINISHED, S.FAILED, S.REJECTED, S.CLOSED})
_UNSENT = (S.SENDING, S.WAITING)  # an attempt with no token delivered
_LIVE = (S.SENDING, S.WAITING, S.STREAMING)  # an attempt whose workers may hold pages
_ENDED = (S.RETRYING, S.FINISHED, S.FAILED, S.CLOSED)  # reachable while the tasks go out

DISAGG_TRANSITIONS: Mapping[tuple[DisaggState, DisaggEvent], DisaggState] = MappingProxyType({
    (S.NEW, E.SEND): S.SENDING,
    (S.NEW, E.REFUSE): S.REJECTED,
    (S.RETRYING, E.SEND): S.SENDING,
    (S.RETRYING, E.REFUSE): S.REJECTED,
    (S.SENDING, E.TASK): S.SENDING,
    (S.STREAMING, E.TASK): S.STREAMING,  # the prompt's worker answered before the last send
    **{(s, E.TASK): s for s in _ENDED},  # ended while its tasks went out: the rest stay unsent
    (S.SENDING, E.SENT): S.WAITING,
    (S.STREAMING, E.SENT): S.STREAMING,
    **{(s, E.SENT): s for s in _ENDED},
    **{(s, E.TOKENS): S.STREAMING for s in _LIVE},
    **{(s, E.FINISH): S.FINISHED for s in _LIVE},
    **{(s, E.WORKER_ERROR): S.FAILED for s in _LIVE},
    **{(s, E.RETRY): S.RETRYING for s in _UNSENT},
    **{(s, E.WORKER_LOST): S.FAILED for s in _LIVE},
    **{(s, E.CLOSE): S.CLOSED for s in (S.NEW, *_LIVE, S.RETRYING)},
    **{(s, E.CLOSE): s for s in _TERMINAL},  # closed again, or after the end: nothing to do
})

# The per-token path takes this one edge without a lookup (DisaggRequest.on_tokens).
if DISAGG_TRANSITIONS[S.STREAMING, E.TOKENS] is not S.STREAMING:
    raise AssertionError("on_tokens' fast path needs STREAMING --TOKENS--> STREAMING")
