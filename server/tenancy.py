"""Tenants: who sent a request (its API key), which prefix-cache namespace it may use, and its
rate limits.

- :class:`KeyRing`: the accepted API keys (``--api-key`` and ``--api-key-file``), each mapped to a
  tenant; the guard (``server.guard``) checks a request's key against it and records the tenant
  in the ASGI scope.
- :func:`cache_namespace`: tenant + ``cache_salt`` -> the namespace the workers' radix cache
  matches in, so different keys or salts never share cached pages, and ``cached_tokens`` never
  counts another tenant's prompt (the timing side channel of arXiv 2411.18191).
- :class:`Tenancy`: applies both to a built :class:`~splitserve.server.job.Job`, and the tenant's
  rate limits (``server.rate_limit``): a refused request is a 429 with ``Retry-After``.
- :func:`require_operator`: the routes that act on every tenant's state (``POST /flush_cache``,
  worker membership and drain/resume) are the operator's: the ``--api-key`` key, or, when no
  key is set, a client on this machine's loopback only (a server on ``--host 0.0.0.0`` without a
  key must not let the network flush its cache or drain its workers). A tenant's key
  (``--api-key-file``) gets 403: flushing would let one tenant evict the others' cache entries
  at will (and time their refill), and a worker it registered would receive the other tenants'
  prompts. A web page on this machine is loopback too: ``server.browser_guard`` keeps browsers
  out.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.server.browser_guard import is_loopback_client
from splitserve.server.errors import APIError
from splitserve.server.job import Job
from splitserve.server.rate_limit import RateLimiter

TENANT_SCOPE_KEY = "splitserve.tenant"  # the guard puts the request's tenant here in the scope
KEYED_SCOPE_KEY = "splitserve.keyed"  # True in the scope once the guard matched a key


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One accepted key. ``tenant`` None: the shared tenant (the single ``--api-key``)."""

    secret: bytes  # b"Bearer <key>", as the Authorization header carries it
    tenant: str | None
    weight: float = 1.0  # its tenant's share of the workers when requests wait (fair queueing)


class KeyRing:
    """The API keys the server accepts, each with its tenant."""

    def __init__(self, keys: list[ApiKey]) -> None:
        if not keys:
            raise ValueError("a key ring needs at least one key")
        self.keys = keys

    @classmethod
    def from_config(cls, api_key: str | None, api_key_file: str | None) -> KeyRing | None:
        """The keys of ``--api-key`` (shared tenant) and ``--api-key-file`` (one tenant each);
        None when neither is set (no key needed).

        The file has one key per line, optionally followed by whitespace and a tenant name,
        and after it a weight (a positive number, default 1: the tenant's share of the workers
        while requests wait, ``server.fair_queue``); blank lines and lines starting with ``#``
        are skipped. A key without a name is its own tenant, named by a hash of the key (never
        the key itself).

        Raises:
            ValueError: the file is missing, unreadable, lists no key, lists a key twice, has
                a weight that is not a positive number, or two weights for one tenant.
        """
        keys = [ApiKey(f"Bearer {api_key}".encode(), None)] if api_key else []
        if api_key_file:
            keys += read_key_file(api_key_file)
        seen: set[bytes] = set()
        for key in keys:
            if key.secret in seen:
                raise ValueError(f"{api_key_file}: the same API key is listed twice")
            seen.add(key.secret)
        return cls(keys) if keys else None

    def weights(self) -> dict[str | None, float]:
        """Tenant -> fair-queueing weight, for every tenant with a weight other than 1."""
        return {key.tenant: key.weight for key in self.keys if key.weight != 1.0}

    def match(self, authorization: bytes) -> ApiKey | None:
        """The key ``authorization`` (the header's value) names, or None. Compares against every
        key, in constant time each, so the time taken does not tell which key nearly matched."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(authorization, key.secret):
                found = key
        return found


def read_key_file(path: str) -> list[ApiKey]:
    """The keys of an ``--api-key-file`` (format: :meth:`KeyRing.from_config`).

    Raises:
        ValueError: missing or unreadable file, no key in it, a bad weight, or two weights for
            one tenant.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: {exc.strerror or exc}") from exc
    keys = []
    weights: dict[str, float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        secret = parts[0]
        tenant = parts[1] if len(parts) > 1 else "key-" + hashlib.sha256(
            secret.encode()).hexdigest()[:12]
        weight = _weight(parts[2], path, number) if len(parts) > 2 else None
        if weight is not None and weights.setdefault(tenant, weight) != weight:
            raise ValueError(f"--api-key-file {path}, line {number}: tenant {tenant} has "
                             f"weight {weights[tenant]:g} on an earlier line")
        keys.append(ApiKey(f"Bearer {secret}".encode(), tenant))
    if not keys:
        raise ValueError(f"--api-key-file {path}: no key in it")
    return [ApiKey(k.secret, k.tenant, weights.get(k.tenant, 1.0)) for k in keys]


def _weight(text: str, path: str, number: int) -> float:
    """The weight written on line ``number`` of the key file.

    Raises:
        ValueError: not a finite positive number.
    """
    try:
        weight = float(text)
    except ValueError:
        weight = float("nan")
    if not (weight > 0 and weight != float("inf")):
        raise ValueError(f"--api-key-file {path}, line {number}: the weight {text!r} is not a "
                         "positive number")
    return weight


def cache_namespace(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache namespace of a request from ``tenant`` with ``cache_salt``; None (the
    shared namespace) only when both are None. A hash: workers never see keys or salts, and
    every namespace has the same size on the wire."""
    if tenant is None and cache_salt is None:
        return None
    # Length-prefixed parts, so ("ab", "c") and ("a", "bc") differ, and None differs from "".
    parts = [b"-" if p is None else f"{len(p)}:{p}".encode() for p in (tenant, cache_salt)]
    return hashlib.sha256(b"splitserve-cache-ns\0" + b"\0".join(parts)).hexdigest()[:32]


def request_tenant(scope: dict[str, Any]) -> str | None:
    """The tenant the guard found for this request (None: shared, or no keys configured)."""
    return scope.get(TENANT_SCOPE_KEY)


def require_operator(scope: dict[str, Any], what: str) -> None:
    """Refuse ``what`` (a route, in words) to anyone but the operator.

    Raises:
        APIError: 403 (``permission_denied``) when the request's key is one of
            ``--api-key-file``'s tenants, or when no key was checked (none is configured) and
            the client is not on loopback; nothing for the operator's ``--api-key``, or for a
            loopback client when no key is configured.
    """
    if request_tenant(scope) is not None:
        raise APIError(f"{what} needs the operator's API key (--api-key); a tenant's key "
                       "(--api-key-file) may not use it", status_code=403,
                       type="permission_error", code="permission_denied")
    if not scope.get(KEYED_SCOPE_KEY) and not is_loopback_client(scope):
        raise APIError(f"{what} is the operator's: with no --api-key set it is served to "
                       "clients on this machine's loopback only; start the server with "
                       "--api-key (or SPLITSERVE_API_KEY) and send it to call it from "
                       "elsewhere", status_code=403, type="permission_error",
                       code="permission_denied")


class Tenancy:
    """Puts a job in its tenant's cache namespace and under its tenant's rate limits."""

    def __init__(self, limiter: RateLimiter | None = None) -> None:
        self.limiter = limiter if limiter is not None and limiter.enabled else None

    def apply(self, scope: dict[str, Any], job: Job, cache_salt: str | None) -> Job:
        """Set ``job.tenant`` and ``job.cache_namespace``; take the request and its prompt
        tokens from the tenant's buckets, and charge its generated tokens as they are produced
        (``job.on_tokens``, per event), so a long answer's tokens count against its tenant's
        next requests while it still streams, not only once it ends. A request the router's
        full queue then refuses gets its admission back (``job.on_refused``).

        Raises:
            APIError: 429 (``rate_limit_exceeded``, with ``Retry-After``) when a limit is reached.
        """
        tenant = request_tenant(scope)
        job.tenant = tenant
        job.cache_namespace = cache_namespace(tenant, cache_salt)
        if self.limiter is None:
            return job
        limiter = self.limiter
        refusal = limiter.admit(tenant, len(job.input_ids))
        if refusal is not None:
            raise APIError(
                f"{refusal.message} for this API key; retry after {refusal.retry_after_s:.1f} s",
                status_code=429, type="rate_limit_error", code="rate_limit_exceeded",
                headers={"Retry-After": refusal.retry_after_header})
        job.on_tokens = lambda count: limiter.charge(tenant, count)
        prompt_len = len(job.input_ids)
        job.on_refused = lambda: limiter.refund(tenant, prompt_len)
        return job
