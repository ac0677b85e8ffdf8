"""One disaggregated cluster (default model) for the lang end-to-end tests, and its Endpoint.

``Endpoint.capabilities()`` probes a server (a regex-constrained request; echo + logprobs; a
repeated prompt's ``cached_tokens``; a named tool call). Against our own server every capability
is required: a probe that comes back negative is a regression, so the ``needs_*`` fixtures fail
the test naming it (they never skip; a skip would hide the regression). Only optional
third-party servers may skip for a feature they lack.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve import lang
from splitserve.launch.local import Cluster
from tests.e2e.conftest import _launch


@pytest.fixture(scope="session")
def lang_cluster(model_path) -> Iterator[Cluster]:
    yield from _launch(model_path, num_prefill=1, num_decode=1)


@pytest.fixture(scope="session")
def endpoint(lang_cluster) -> lang.Endpoint:
    return lang.Endpoint(lang_cluster.config.url)


def require(endpoint: lang.Endpoint, capability: str, what: str) -> None:
    """Fail (never skip) when our own server's probe for ``capability`` came back negative."""
    caps = endpoint.capabilities()
    assert getattr(caps, capability), f"our server lost a capability: {what} ({caps})"


@pytest.fixture
def needs_constraints(endpoint) -> None:
    require(endpoint, "constraints", "a regex-constrained probe came back unconstrained")


@pytest.fixture
def needs_prefix_cache(endpoint) -> None:
    require(endpoint, "prefix_cache", "a repeated prompt reported no cached_tokens")
