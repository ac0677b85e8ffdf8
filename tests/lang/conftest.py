"""One disaggregated cluster (default model) for the lang end-to-end tests, and its Endpoint.

Features other branches add are detected, not assumed: ``Endpoint.capabilities()`` probes the
server (a regex-constrained request; echo + logprobs; a repeated prompt's ``cached_tokens``), and
tests that need a missing feature skip saying which.
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


@pytest.fixture
def needs_constraints(endpoint) -> None:
    if not endpoint.capabilities().constraints:
        pytest.skip("server does not enforce constraints yet (structured-generation branch)")


@pytest.fixture
def needs_prefix_cache(endpoint) -> None:
    if not endpoint.capabilities().prefix_cache:
        pytest.skip("server reports no cached_tokens yet (radix-cache branch)")
