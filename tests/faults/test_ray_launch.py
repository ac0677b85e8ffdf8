"""The cluster spec YAML, and a 1 prefill + 1 decode launch on a local Ray instance serving a
completion, a Responses and a Messages request (skipped without Ray: ``pip install 'splitserve[ray]'``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from splitserve.launch.ray import RayClusterSpec, launch_on_ray, wait_healthy
from tests.e2e.conftest import free_port
from tests.faults.local_ray import local_ray

SPEC = """
model: {model}
router: {{port: {port}}}
prefill: {{count: 1, num_cpus: 1, kv_cache_mb: 32}}
decode: {{count: 1, num_cpus: 1, kv_cache_mb: 32}}
engine: {{dtype: float32, page_size: 16}}
host: 127.0.0.1
"""


def test_spec_parses_and_rejects_unknown_keys() -> None:
    spec = RayClusterSpec.from_yaml(SPEC.format(model="/m", port=8123))
    assert spec.router_port == 8123 and spec.decode.kv_cache_mb == 32
    assert spec.router_inbox_port == 0
    routed = RayClusterSpec.from_yaml("model: /m\nrouter: {inbox_port: 9001, resources: {r: 1}}\n")
    assert routed.router_inbox_port == 9001 and routed.router_resources == {"r": 1}
    with pytest.raises(ValueError, match="router: unknown keys"):
        RayClusterSpec.from_yaml("model: /m\nrouter: {prot: 1}\n")
    assert (spec.engine.dtype, spec.engine.page_size) == ("float32", 16)
    assert spec.host == "127.0.0.1" and RayClusterSpec.from_yaml("model: /m\n").host is None
    with pytest.raises(ValueError, match="unknown keys"):
        RayClusterSpec.from_yaml("model: /m\nprefill: {cout: 2}\n")
    with pytest.raises(ValueError, match="model"):
        RayClusterSpec.from_yaml("prefill: {count: 2}\n")


def test_spec_takes_the_tracing_settings_of_every_process() -> None:
    spec = RayClusterSpec.from_yaml(
        "model: /m\ntracing: {otlp_traces_endpoint: http://h:4318/v1/traces, sample_ratio: 0.5}\n")
    assert (spec.tracing.otlp_traces_endpoint, spec.tracing.sample_ratio) == (
        "http://h:4318/v1/traces", 0.5)
    assert not RayClusterSpec.from_yaml("model: /m\n").tracing.enabled
    with pytest.raises(ValueError, match="tracing: sample_ratio"):
        RayClusterSpec.from_yaml("model: /m\ntracing: {sample_ratio: 2}\n")


@pytest.mark.slow
def test_launch_on_local_ray(model_path: Path) -> None:
    with local_ray(num_cpus=4) as ray:
        handles = []
        try:
            spec = RayClusterSpec.from_yaml(SPEC.format(model=model_path, port=free_port()))
            url, handles = launch_on_ray(None, spec)
            wait_healthy(url, 2, timeout_s=300)
            body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8,
                    "temperature": 0}
            out = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert out.status_code == 200 and "Paris" in out.json()["choices"][0]["text"]
            # The Responses API through the same router and workers (store: false, so nothing is
            # written to the cache folder's store).
            made = httpx.post(url + "/v1/responses", timeout=120, json={
                "model": "default", "input": "What is the capital of France?", "temperature": 0,
                "max_output_tokens": 16, "store": False})
            assert made.status_code == 200, made.text
            text = "".join(part["text"] for item in made.json()["output"]
                           for part in item.get("content", ()))
            assert "Paris" in text
            # The Messages API (Anthropic's shape) through the same router and workers.
            said = httpx.post(url + "/v1/messages", timeout=120, json={
                "model": "default", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert said.status_code == 200, said.text
            body = said.json()
            assert body["type"] == "message" and body["stop_reason"] in ("end_turn", "max_tokens")
            assert "Paris" in "".join(b["text"] for b in body["content"] if b["type"] == "text")
        finally:
            if handles:
                ray.get([h.stop.remote() for h in reversed(handles)])
