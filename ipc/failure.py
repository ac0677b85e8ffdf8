"""The causes a worker names when it fails a request: one enum shared by the failure messages."""

from __future__ import annotations

import enum


class FailureKind(enum.StrEnum):
    """Why a worker failed a request, as it travels (``RequestError.kind``, ``KVFailed.kind``).

    On the wire it is a plain string, so a reader older or newer than the sender still decodes
    the message; :meth:`parse` maps a string back (an unknown one to ``default``).
    """

    INVALID = "invalid"  # the task cannot run on this worker (prompt too long, ...): a 400
    GRAMMAR = "grammar"  # its constraint did not compile, or refused the first token
    TRANSFER = "transfer"  # its KV handoff failed, timed out, or was refused at the handshake
    ROUTER_GONE = "router_gone"  # the router that sent it went away: nobody to stream to

    @classmethod
    def parse(cls, value: str, default: FailureKind) -> FailureKind:
        """The kind named ``value``, or ``default`` when it names none (an older sender)."""
        try:
            return cls(value)
        except ValueError:
            return default
