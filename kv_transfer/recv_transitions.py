"""The decode side's transition tables: every ``(state, event) -> next state`` that a
:class:`~splitserve.kv_transfer.recv_session.RecvSession` allows, one table per kind of backend;
any other pair raises :class:`~splitserve.kv_transfer.session.IllegalTransition`. An edge back
to the same state is a message that changes nothing there (late, or fenced: a fence wins). The
states are documented on :class:`~splitserve.kv_transfer.session.TransferState`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from splitserve.kv_transfer.session import TransferState

T = TransferState


class RecvEvent(enum.Enum):
    """What can happen to a decode-side session (the value says what)."""

    RESERVE = "pages reserved, KVBootstrap sent"
    KEEPALIVE = "KVKeepalive from the prefill worker"
    PAGES = "a KVPages message that is not the last"
    LAST_PAGES = "the last KVPages message, with the first token"
    FINISHED = "the last KVPages message, and the first token ended the request"
    START = "handed to the scheduler"
    KV_FAILED = "KVFailed from the prefill worker"
    FAIL = "it failed here (bad pages, grammar, deadline)"
    ABORT = "AbortTask from the server"
    RELEASED = "KVReleased from the prefill worker"
    LINK_DROPPED = "the link to the prefill worker dropped"
    TIMEOUT = "the state's deadline passed"


E = RecvEvent
_LATE = (E.KEEPALIVE, E.PAGES, E.LAST_PAGES, E.FINISHED, E.KV_FAILED, E.RELEASED)
_FAILURES = (E.FAIL, E.ABORT, E.KV_FAILED, E.TIMEOUT)

# Two-sided backend (zmq): only the receiver writes into the pool, so a failure frees at once.
RECV_TRANSITIONS: Mapping[tuple[TransferState, RecvEvent], TransferState] = MappingProxyType({
    (T.QUEUED, E.RESERVE): T.WAITING_FOR_PAGES,
    (T.QUEUED, E.FAIL): T.FAILED,
    (T.QUEUED, E.ABORT): T.FAILED,
    (T.QUEUED, E.TIMEOUT): T.FAILED,
    **{(T.QUEUED, e): T.QUEUED for e in _LATE},  # nothing bootstrapped yet: ignored
    (T.WAITING_FOR_PAGES, E.KEEPALIVE): T.WAITING_FOR_PAGES,
    (T.WAITING_FOR_PAGES, E.PAGES): T.WAITING_FOR_PAGES,
    (T.WAITING_FOR_PAGES, E.LAST_PAGES): T.KV_READY,
    (T.WAITING_FOR_PAGES, E.FINISHED): T.DONE,
    (T.WAITING_FOR_PAGES, E.RELEASED): T.WAITING_FOR_PAGES,  # ignored: nothing was fenced
    **{(T.WAITING_FOR_PAGES, e): T.FAILED for e in _FAILURES},
    (T.KV_READY, E.START): T.DONE,
    (T.KV_READY, E.FAIL): T.FAILED,  # the last message came: nothing writes any more
    (T.KV_READY, E.ABORT): T.FAILED,
    **{(T.KV_READY, e): T.KV_READY for e in _LATE},
})

# One-sided backends (shm, mooncake, nixl): a failure while the KV arrives fences the pages.
RECV_TRANSITIONS_ONE_SIDED: Mapping[tuple[TransferState, RecvEvent], TransferState] = (
    MappingProxyType({
        **RECV_TRANSITIONS,
        **{(T.WAITING_FOR_PAGES, e): T.FENCED for e in _FAILURES},
        (T.FENCED, E.RELEASED): T.FAILED,
        (T.FENCED, E.LINK_DROPPED): T.FAILED,
        (T.FENCED, E.TIMEOUT): T.FAILED,
        **{(T.FENCED, e): T.FENCED for e in (E.KEEPALIVE, E.PAGES, E.LAST_PAGES, E.FINISHED,
                                             E.KV_FAILED, E.FAIL, E.ABORT)},  # fenced wins
    })
)
