"""Multi-host launch on an existing Ray cluster: ``splitserve launch --ray ADDRESS --config
cluster.yaml``. Ray is an optional extra (``pip install splitserve[ray]``).

Ray only places and keeps processes: each worker and the router run as an ordinary
``python -m splitserve ...`` child of a small Ray actor that reserves the role's resources on some
node (``num_cpus``/``num_gpus``/custom ``resources``, or a pinned ``node_ip``). Workers join the
router with ``--router`` exactly as when started by hand (the plain per-host commands in
docs/operations.md), advertising their node's IP. Each child gets its whole config as ``--config-json``
(``engine`` is an :class:`~splitserve.config.EngineConfig`: an unknown key is an error), and
exits when its actor's process does (``ray.shutdown()``, a killed actor or node), as under the
local launcher.

A node's IP is what Ray reports, and Ray never reports loopback: it replaces ``127.0.0.1`` with
a reachable address, even given ``ray.init(_node_ip_address="127.0.0.1")``. A one-node cluster
that should stay on loopback says ``host: 127.0.0.1``: every process binds and advertises that.

cluster.yaml::

    model: /models/SmolLM2-135M-Instruct     # same path on every node
    router: {port: 8000, inbox_port: 8001, node_ip: 10.0.0.1, num_cpus: 1}  # node_ip (or resources) pins it
    prefill: {count: 2, port: 7001, num_cpus: 8}
    decode:  {count: 2, port: 7002, num_cpus: 8, kv_cache_mb: 4096}
    engine:  {dtype: bfloat16, page_size: 16}  # flags for every worker
    curve_keys: /etc/splitserve/cluster.keys   # optional; same file on every node
    tracing: {otlp_traces_endpoint: http://10.0.0.9:4318/v1/traces}  # optional, every process
    host: 127.0.0.1                            # optional, one node: bind this, not the node's IP
    placement_timeout_s: 60                    # optional: a process not started by then is an error

A process no node could ever hold is an error at once, one that waits for resources others took
is an error after ``placement_timeout_s``; both name what it asked for and what each node has
(``launch.ray_placement``).

Ports each host must open, and the multi-host and KubeRay recipes: ``docs/multihost.md``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from splitserve.config import (
    EngineConfig,
    SecurityConfig,
    ServeConfig,
    ServerConfig,
    TracingConfig,
    WorkerConfig,
    env,
)
from splitserve.config.schema import to_json
from splitserve.launch.ray_host import ProcessHost, check_ray_address
from splitserve.launch.ray_placement import (
    Ask,
    RayPlacementError,
    ask_from_options,
    check_placeable,
    wait_placed,
)

ROLE_KEYS = ("count", "port", "num_cpus", "num_gpus", "resources", "node_ip", "kv_cache_mb")


@dataclass(slots=True)
class RoleSpec:
    count: int = 1
    port: int = 0  # 0: any free port
    num_cpus: float = 1
    num_gpus: float = 0
    resources: dict[str, float] = field(default_factory=dict)
    node_ip: str | None = None
    kv_cache_mb: int | None = None


@dataclass(slots=True)
class RayClusterSpec:
    model: str
    router_port: int = 8000
    router_node_ip: str | None = None
    router_resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources
    router_num_cpus: float = 1  # the router's own CPUs (0: it reserves none)
    router_inbox_port: int = 0  # the router's ZeroMQ inbox, where workers reply (0: any free)
    prefill: RoleSpec = field(default_factory=RoleSpec)
    decode: RoleSpec = field(default_factory=RoleSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)
    curve_keys: str | None = None
    host: str | None = None  # what every process binds and advertises (None: its node's IP)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # for every process
    placement_timeout_s: float = 60.0  # every process started by then, or RayPlacementError

    @classmethod
    def from_yaml(cls, text: str) -> RayClusterSpec:
        """Raises: ValueError naming the first bad key."""
        import yaml

        d = yaml.safe_load(text) or {}
        if "model" not in d:
            raise ValueError("cluster spec: 'model' is required")
        roles = {}
        for role in ("prefill", "decode"):
            r = d.get(role) or {}
            bad = set(r) - set(ROLE_KEYS)
            if bad:
                raise ValueError(f"cluster spec: {role}: unknown keys {sorted(bad)}")
            roles[role] = RoleSpec(**r)
        router = d.get("router") or {}
        try:
            engine = msgspec.convert({**(d.get("engine") or {}), "model": str(d["model"])},
                                     EngineConfig)
            engine.check()
        except (msgspec.ValidationError, ValueError) as exc:
            raise ValueError(f"cluster spec: engine: {exc}") from exc
        try:
            tracing = msgspec.convert(d.get("tracing") or {}, TracingConfig)
            tracing.check()
        except (msgspec.ValidationError, ValueError) as exc:
            raise ValueError(f"cluster spec: tracing: {exc}") from exc
        bad = set(router) - {"port", "node_ip", "resources", "inbox_port", "num_cpus"}
        if bad:
            raise ValueError(f"cluster spec: router: unknown keys {sorted(bad)}")
        bad = set(d) - {"model", "router", "prefill", "decode", "engine", "curve_keys", "host",
                        "tracing", "placement_timeout_s"}
        if bad:
            raise ValueError(f"cluster spec: unknown keys {sorted(bad)}")
        placement_timeout_s = float(d.get("placement_timeout_s", 60.0))
        router_num_cpus = float(router.get("num_cpus", 1))
        if placement_timeout_s <= 0 or router_num_cpus < 0:
            raise ValueError("cluster spec: placement_timeout_s must be > 0 and "
                             "router.num_cpus >= 0")
        return cls(model=d["model"], router_port=router.get("port", 8000),
                   router_node_ip=router.get("node_ip"),
                   router_resources=dict(router.get("resources") or {}),
                   router_num_cpus=router_num_cpus, placement_timeout_s=placement_timeout_s,
                   router_inbox_port=router.get("inbox_port", 0), engine=engine,
                   curve_keys=d.get("curve_keys"), host=d.get("host"), tracing=tracing,
                   **roles)


def _options(role: RoleSpec | None, node_ip: str | None) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": role.num_cpus if role else 1}
    if role is not None and role.num_gpus:
        opts["num_gpus"] = role.num_gpus
    resources = dict(role.resources) if role else {}
    if node_ip:
        resources[f"node:{node_ip}"] = 0.001  # Ray's built-in per-node resource
    if resources:
        opts["resources"] = resources
    return opts


MAX_RESTARTS = 5  # as the local launcher: a process that keeps dying is not restarted forever


def launch_on_ray(address: str | None, spec: RayClusterSpec,
                  security: SecurityConfig | None = None, log_level: str = "warning"):
    """Start the router and workers on the Ray cluster at ``address`` (None: the Ray instance
    this process already joined or started). Returns ``(router_url, handles)``; keep the
    handles alive (dropping them stops the processes).

    Each process lives in a :class:`ProcessHost` actor that Ray restarts (up to
    ``MAX_RESTARTS`` times) when the process exits or its node dies; a restarted worker lands on
    any node that has its role's resources, starts again and joins the router (``--router``).

    Raises:
        ConnectionError: nothing answers at ``address`` (instead of Ray's endless retries).
        RayPlacementError: a process no node can hold (at once), or one not started within
            ``spec.placement_timeout_s``; every process started so far is stopped first.
    """
    import ray

    if address is not None:
        check_ray_address(address)
    ray.init(address=address, ignore_reinit_error=True)
    host_cls = ray.remote(max_restarts=MAX_RESTARTS)(ProcessHost)
    security = msgspec.structs.replace(security or SecurityConfig(), curve_keys=spec.curve_keys)
    # A child dies with its actor's process. Recent Ray kills an exiting worker's children too
    # (RAY_kill_child_processes_on_worker_exit); this holds where that is off or absent.
    child_env = {env.DIE_WITH_PARENT: "1"}
    if security.api_key:
        child_env[env.API_KEY] = security.api_key
    server = ServeConfig(engine=spec.engine, server=ServerConfig(port=spec.router_port),
                         security=security, tracing=spec.tracing, log_level=log_level)
    router_role = RoleSpec(num_cpus=spec.router_num_cpus, resources=spec.router_resources)
    router_options = _options(router_role, spec.router_node_ip)
    asks = [ask_from_options("router", router_options)]
    for role_name in ("prefill", "decode"):
        role = getattr(spec, role_name)
        asks += [ask_from_options(f"{role_name}-{i}", _options(role, role.node_ip))
                 for i in range(role.count)]
    check_placeable(asks, ray.nodes())
    router = host_cls.options(**router_options).remote(
        "api-server", json.loads(to_json(server)), child_env, host=spec.host,
        port=spec.router_inbox_port)
    handles = [router]
    try:
        _wait_placed(ray, asks[:1], handles, spec.placement_timeout_s)
    except RayPlacementError:
        _kill(ray, handles)
        raise
    url = f"http://{ray.get(router.node_ip.remote())}:{spec.router_port}"
    for role_name in ("prefill", "decode"):
        role: RoleSpec = getattr(spec, role_name)
        engine = spec.engine
        if role.kv_cache_mb:
            engine = msgspec.structs.replace(engine, kv_cache_mb=role.kv_cache_mb)
        for i in range(role.count):
            worker = WorkerConfig(
                role=role_name, worker_id=f"{role_name}-{i}", addr="", router_urls=[url],
                num_threads=int(role.num_cpus), engine=engine, security=security,
                tracing=spec.tracing, log_level=log_level,
            )
            port = role.port + i if role.port else 0
            handles.append(host_cls.options(**_options(role, role.node_ip)).remote(
                "worker", json.loads(to_json(worker)), child_env, host=spec.host, port=port))
    try:
        _wait_placed(ray, asks, handles, spec.placement_timeout_s)
    except RayPlacementError:
        _kill(ray, handles)
        raise
    ray.get([h.pid.remote() for h in handles])  # an actor that failed to start raises here
    return url, handles


def _wait_placed(ray: Any, asks: list[Ask], handles: list, timeout_s: float) -> None:
    from ray._private.state import available_resources_per_node

    wait_placed(list(zip(asks, [h.pid.remote() for h in handles], strict=True)), timeout_s,
                wait=lambda refs, t: ray.wait(refs, num_returns=len(refs), timeout=t),
                nodes=ray.nodes, available=available_resources_per_node)


def _kill(ray: Any, handles: list) -> None:
    """Stop every started process and its actor (no restart), after a failed placement."""
    for handle in handles:
        ray.kill(handle, no_restart=True)


def wait_healthy(url: str, num_workers: int, timeout_s: float = 300,
                 api_key: str | None = None) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rows = httpx.get(url + "/workers", timeout=5, headers=headers).json()
            if len(rows) == num_workers and all(r["healthy"] for r in rows):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{num_workers} workers not healthy at {url} within {timeout_s:g} s")
