"""The prefill side's transition table: every ``(state, event) -> next state`` that a
:class:`~splitserve.kv_transfer.send_session.SendSession` allows; any other pair raises
:class:`~splitserve.kv_transfer.session.IllegalTransition`. An edge back to the same state is a
message that changes nothing there (late, or the request failed already: failed wins). The
states are documented on :class:`~splitserve.kv_transfer.session.TransferState`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from splitserve.kv_transfer.session import TransferState

T = TransferState


class SendEvent(enum.Enum):
    """What can happen to a prefill-side session (the value says what)."""

    TASK = "the GenerateTask arrived"
    BOOTSTRAP = "the decode worker's KVBootstrap arrived"
    QUEUED = "KVQueued: the decode worker still queues it for pages"
    PAGES_COMPUTED = "a step completed more prompt pages"
    PREFILLED = "the first token was sampled"
    DRAINED = "the backend no longer reads (or writes) the request's pages"
    KV_FAILED = "KVFailed from the decode worker"
    KV_FAILED_ACK = "KVFailed from the decode worker, asking for KVReleased"
    FAIL = "it failed here (send error, grammar, refused bootstrap)"
    ABORT = "AbortTask from the server"
    TIMEOUT = "the state's deadline passed"


E = SendEvent
_LIVE = (T.WAITING_FOR_TASK, T.BOOTSTRAPPING, T.PREFILLED, T.TRANSFERRING)

SEND_TRANSITIONS: Mapping[tuple[TransferState, SendEvent], TransferState] = MappingProxyType({
    (T.WAITING_FOR_TASK, E.TASK): T.TRANSFERRING,
    (T.WAITING_FOR_TASK, E.QUEUED): T.WAITING_FOR_TASK,  # late: the bootstrap came
    (T.WAITING_FOR_TASK, E.TIMEOUT): T.FAILED,  # the task failed validation or was aborted
    (T.BOOTSTRAPPING, E.BOOTSTRAP): T.TRANSFERRING,
    (T.BOOTSTRAPPING, E.QUEUED): T.BOOTSTRAPPING,
    (T.BOOTSTRAPPING, E.PREFILLED): T.PREFILLED,
    (T.BOOTSTRAPPING, E.TIMEOUT): T.FAILED,
    (T.PREFILLED, E.BOOTSTRAP): T.DRAINING,  # every page goes out at once
    (T.PREFILLED, E.QUEUED): T.PREFILLED,
    (T.PREFILLED, E.TIMEOUT): T.FAILED,
    (T.TRANSFERRING, E.QUEUED): T.TRANSFERRING,  # late: the bootstrap came
    (T.TRANSFERRING, E.PAGES_COMPUTED): T.TRANSFERRING,
    (T.TRANSFERRING, E.PREFILLED): T.DRAINING,
    **{(s, E.FAIL): T.FAILED for s in _LIVE},
    **{(s, E.ABORT): T.FAILED for s in _LIVE},
    **{(s, E.KV_FAILED): T.FAILED for s in _LIVE},
    **{(s, E.KV_FAILED_ACK): T.RELEASING for s in _LIVE},
    # Everything is sent: the pages stay held while the backend reads them, whatever comes.
    (T.DRAINING, E.DRAINED): T.DONE,
    (T.DRAINING, E.TIMEOUT): T.DONE,  # the peer stopped reading: its queue is dropped
    (T.DRAINING, E.QUEUED): T.DRAINING,
    (T.DRAINING, E.FAIL): T.DRAINING,
    (T.DRAINING, E.ABORT): T.DRAINING,
    (T.DRAINING, E.KV_FAILED): T.DRAINING,
    (T.DRAINING, E.KV_FAILED_ACK): T.RELEASING,
    # Failed: late messages change nothing.
    (T.RELEASING, E.DRAINED): T.FAILED,  # KVReleased sent
    (T.RELEASING, E.TIMEOUT): T.FAILED,  # a write that never ends: not acknowledged
    **{(T.RELEASING, e): T.RELEASING for e in (E.TASK, E.BOOTSTRAP, E.QUEUED, E.FAIL, E.ABORT,
                                                E.KV_FAILED, E.KV_FAILED_ACK)},
})
