"""Ray placement that cannot happen is said, not waited on: the pure checks of
``launch.ray_placement`` on made-up node tables with a fake clock, and ``launch_on_ray`` on a
local two-CPU Ray instance asking for more than it has (skipped without Ray)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from splitserve.launch.ray import RayClusterSpec, launch_on_ray
from splitserve.launch.ray_placement import (
    Ask,
    RayPlacementError,
    ask_from_options,
    check_placeable,
    unplaceable,
    wait_placed,
)
from tests.e2e.conftest import free_port
from tests.faults.local_ray import local_ray

HEAD = {"NodeID": "h", "NodeManagerAddress": "10.0.0.1", "Alive": True,
        "Resources": {"CPU": 1.0, "node:10.0.0.1": 1.0}}
WORKER = {"NodeID": "w", "NodeManagerAddress": "10.0.0.2", "Alive": True,
          "Resources": {"CPU": 8.0, "GPU": 1.0, "node:10.0.0.2": 1.0}}
DEAD = {"NodeID": "d", "NodeManagerAddress": "10.0.0.3", "Alive": False,
        "Resources": {"CPU": 64.0}}


def test_asks_use_rays_resource_names() -> None:
    ask = ask_from_options("prefill-0", {"num_cpus": 4, "num_gpus": 1,
                                         "resources": {"node:10.0.0.2": 0.001, "fast": 1}})
    assert dict(ask.resources) == {"CPU": 4.0, "GPU": 1.0, "node:10.0.0.2": 0.001, "fast": 1.0}
    assert dict(ask_from_options("router", {"num_cpus": 0}).resources) == {}


def test_an_ask_no_alive_node_holds_is_refused_at_once_naming_it_and_the_nodes() -> None:
    asks = [Ask("router", {"CPU": 1}), Ask("prefill-0", {"CPU": 16}),
            Ask("decode-0", {"CPU": 1, "node:10.0.0.1": 0.001}),
            Ask("decode-1", {"GPU": 1, "CPU": 2})]
    assert [a.name for a in unplaceable(asks, [HEAD, WORKER, DEAD])] == ["prefill-0"]
    with pytest.raises(RayPlacementError) as err:
        check_placeable(asks, [HEAD, WORKER, DEAD])
    text = str(err.value)
    assert "prefill-0 asks for {CPU: 16}" in text
    assert "10.0.0.1: total {CPU: 1" in text and "10.0.0.2: total {CPU: 8, GPU: 1" in text
    assert "10.0.0.3" not in text  # a dead node holds nothing
    check_placeable(asks[:1] + asks[2:], [HEAD, WORKER])  # the others fit: no error


class FakeRay:
    """``ray.wait`` over refs that become ready at given fake times."""

    def __init__(self, ready_at: dict[str, float]) -> None:
        self.now = 0.0
        self.ready_at = ready_at

    def clock(self) -> float:
        return self.now

    def wait(self, refs: list, timeout: float) -> tuple[list, list]:
        due = [self.ready_at[r] for r in refs if self.ready_at[r] != float("inf")]
        self.now = min([self.now + timeout, *(t for t in due if t > self.now)])
        ready = [r for r in refs if self.ready_at[r] <= self.now]
        return ready, [r for r in refs if r not in ready]


def test_a_process_still_waiting_at_the_deadline_is_named_with_the_free_resources() -> None:
    fake = FakeRay({"r": 1.0, "p": 2.0, "d": float("inf")})
    started = [(Ask("router", {"CPU": 1}), "r"), (Ask("prefill-0", {"CPU": 1}), "p"),
               (Ask("decode-0", {"CPU": 1, "node:10.0.0.1": 0.001}), "d")]
    with pytest.raises(RayPlacementError) as err:
        wait_placed(started, 30, wait=fake.wait, nodes=lambda: [HEAD],
                    available=lambda: {"h": {"CPU": 0.0}}, clock=fake.clock)
    assert fake.now == 30.0
    text = str(err.value)
    assert "decode-0 asks for {CPU: 1, node:10.0.0.1: 0.001}" in text
    assert "router" not in text.split("What the nodes have")[0]
    assert "free {CPU: 0, node:10.0.0.1: 0}" in text
    fake = FakeRay({"r": 1.0, "p": 2.0})
    wait_placed(started[:2], 30, wait=fake.wait, nodes=lambda: [HEAD],
                available=lambda: None, clock=fake.clock)
    assert fake.now == 2.0  # returned as soon as both ran


def test_spec_takes_the_routers_cpus_and_a_placement_bound() -> None:
    spec = RayClusterSpec.from_yaml("model: /m\nrouter: {num_cpus: 0}\nplacement_timeout_s: 5\n")
    assert (spec.router_num_cpus, spec.placement_timeout_s) == (0.0, 5.0)
    default = RayClusterSpec.from_yaml("model: /m\n")
    assert (default.router_num_cpus, default.placement_timeout_s) == (1.0, 60.0)
    with pytest.raises(ValueError, match="unknown keys"):
        RayClusterSpec.from_yaml("model: /m\nplacement_timout_s: 5\n")
    with pytest.raises(ValueError, match="placement_timeout_s"):
        RayClusterSpec.from_yaml("model: /m\nplacement_timeout_s: 0\n")


@pytest.mark.slow
def test_launch_on_ray_says_what_cannot_be_placed(model_path: Path) -> None:
    with local_ray(num_cpus=2) as ray:
        too_big = RayClusterSpec.from_yaml(
            f"model: {model_path}\nrouter: {{port: {free_port()}}}\n"
            "prefill: {count: 1, num_cpus: 16}\nhost: 127.0.0.1\n")
        t0 = time.monotonic()
        with pytest.raises(RayPlacementError, match=r"prefill-0 asks for \{CPU: 16\}"):
            launch_on_ray(None, too_big)
        assert time.monotonic() - t0 < 30  # said at once, not after the placement bound
        # Each fits alone, not together: the router takes both CPUs.
        taken = RayClusterSpec.from_yaml(
            f"model: {model_path}\nrouter: {{port: {free_port()}, num_cpus: 2}}\n"
            "prefill: {count: 1, num_cpus: 1}\ndecode: {count: 1, num_cpus: 0}\n"
            "engine: {dtype: float32}\nhost: 127.0.0.1\nplacement_timeout_s: 20\n")
        with pytest.raises(RayPlacementError, match=r"prefill-0 asks for \{CPU: 1\}") as err:
            launch_on_ray(None, taken)
        assert "free {CPU: 0" in str(err.value), str(err.value)
        assert "router asks" not in str(err.value)
        t0 = time.monotonic()
        while ray.available_resources().get("CPU") != 2.0:  # the started ones were stopped
            assert time.monotonic() - t0 < 60, ray.available_resources()
            time.sleep(0.5)
