"""Optional ZeroMQ CURVE for worker links: every inbox is a CURVE server, every link to it a CURVE
client, and a ZAP handler admits only clients holding the cluster's key.

One key pair per cluster, in a file readable only by the cluster's user (``splitserve keygen``).
A process without the secret key cannot connect: CURVE makes the client prove it holds the secret
key of the public key it presents, and the ZAP handler accepts only the cluster's public key.
Traffic is encrypted as well. Needs libzmq built with libsodium (``zmq.has("curve")``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(slots=True, frozen=True)
class CurveKeys:
    public: bytes  # Z85, 40 bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support (built without libsodium)")
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CurveKeys:
        """Read a key file written by :meth:`save`.

        Raises:
            ValueError: the file is not a key file.
        """
        try:
            d = json.loads(Path(path).read_text())
            keys = cls(d["public"].encode(), d["secret"].encode())
        except (KeyError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: not a splitserve CURVE key file") from exc
        if len(keys.public) != 40 or len(keys.secret) != 40:
            raise ValueError(f"{path}: keys must be 40-character Z85 strings")
        return keys

    def save(self, path: str | os.PathLike) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"public": self.public.decode(), "secret": self.secret.decode()}, f)


def apply_curve_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make a (bound) socket a CURVE server. Call before bind."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def apply_curve_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make a (connecting) socket a CURVE client of a cluster inbox. Call before connect."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


class _OnlyClusterKey:
    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Start the ZAP handler of ``ctx`` (one per context) admitting only the cluster key."""
    sync_ctx = zmq.Context.shadow(ctx.underlying)
    auth = ThreadAuthenticator(sync_ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_OnlyClusterKey(keys.public))
    return auth
