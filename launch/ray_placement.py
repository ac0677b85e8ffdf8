"""Whether Ray can place every process of a cluster spec, said within seconds instead of never.

Ray queues an actor whose resources no node has and says nothing to the caller: ``ray.get`` on
it waits forever (Ray only logs "infeasible" in its own logs). The launcher asks here instead:

- :func:`unplaceable` -- before anything waits, each process's ask against every alive node's
  *total* resources: an ask no node could ever hold is an error at once.
- :func:`wait_placed` -- then every process gets ``timeout_s`` to start; the ones still waiting
  are reported with what they asked for and what each node has left (the case where the asks
  fit one by one but not together: the router took the only CPU of the node a worker needs).

Resource dicts use Ray's names: ``CPU``, ``GPU``, custom resources, and ``node:<ip>`` (Ray's
built-in per-node resource, which pins a process to a node). Reference: Ray's scheduling docs
("infeasible tasks") and placement-group diagnostics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class RayPlacementError(RuntimeError):
    """Some process of the cluster spec cannot be (or was not) placed on the Ray cluster; the
    message names each one, what it asked for, and what the nodes have."""


@dataclass(frozen=True, slots=True)
class Ask:
    """One process's resource request. ``name``: ``router``, ``prefill-0``, ...; ``resources``:
    Ray resource name -> amount (``CPU``, ``GPU``, custom, ``node:<ip>``)."""

    name: str
    resources: Mapping[str, float]


def ask_from_options(name: str, options: Mapping[str, Any]) -> Ask:
    """The :class:`Ask` of ``actor.options(**options)`` (``num_cpus``, ``num_gpus``,
    ``resources``), in Ray's resource names."""
    resources: dict[str, float] = {}
    if options.get("num_cpus"):
        resources["CPU"] = float(options["num_cpus"])
    if options.get("num_gpus"):
        resources["GPU"] = float(options["num_gpus"])
    for key, amount in (options.get("resources") or {}).items():
        resources[key] = float(amount)
    return Ask(name, resources)


def _fits(ask: Mapping[str, float], has: Mapping[str, float]) -> bool:
    return all(has.get(key, 0.0) + 1e-9 >= amount for key, amount in ask.items())


def _fmt(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in sorted(resources.items())
             if not k.startswith(("memory", "object_store_memory", "node:__internal"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def describe_nodes(nodes: Sequence[Mapping[str, Any]],
                   available: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """One line per alive node: its IP, total resources, and (where known) what is left.

    Args:
        nodes: ``ray.nodes()`` rows (``NodeID``, ``NodeManagerAddress``, ``Resources``,
            ``Alive``).
        available: node id -> resources still free (``available_resources_per_node``).
    """
    lines = []
    for node in nodes:
        if not node.get("Alive", True):
            continue
        line = f"  node {node.get('NodeManagerAddress', '?')}: total {_fmt(node['Resources'])}"
        if available is not None:  # Ray leaves out what is used up: show it as 0
            free = available.get(node.get("NodeID", ""), {})
            line += f", free {_fmt({k: free.get(k, 0.0) for k in node['Resources']})}"
        lines.append(line)
    return "\n".join(lines) or "  (no alive node)"


def unplaceable(asks: Sequence[Ask], nodes: Sequence[Mapping[str, Any]]) -> list[Ask]:
    """The asks that no alive node's total resources can hold, whatever else runs."""
    alive = [n["Resources"] for n in nodes if n.get("Alive", True)]
    return [a for a in asks if not any(_fits(a.resources, has) for has in alive)]


def check_placeable(asks: Sequence[Ask], nodes: Sequence[Mapping[str, Any]]) -> None:
    """Raises: RayPlacementError naming every ask that no node could ever hold."""
    bad = unplaceable(asks, nodes)
    if bad:
        wants = "; ".join(f"{a.name} asks for {_fmt(a.resources)}" for a in bad)
        raise RayPlacementError(
            f"Ray cannot place {wants}: no node has that much. The nodes:\n"
            f"{describe_nodes(nodes)}\nLower num_cpus/num_gpus/resources in the cluster spec, "
            "or add a node that has them.")


def wait_placed(started: Sequence[tuple[Ask, Any]], timeout_s: float,
                wait: Callable[[list, float], tuple[list, list]],
                nodes: Callable[[], Sequence[Mapping[str, Any]]],
                available: Callable[[], Mapping[str, Mapping[str, float]] | None],
                clock: Callable[[], float] = time.monotonic) -> None:
    """Wait until every process has started, at most ``timeout_s`` seconds.

    Args:
        started: ``(ask, ref)`` per process; ``ref`` resolves once its actor runs (its
            ``pid.remote()``).
        wait: ``ray.wait``-like: ``(refs, timeout_s) -> (ready, pending)``.
        nodes: ``ray.nodes``; available: free resources per node id (None if unknown).
    Raises:
        RayPlacementError: some process has not started after ``timeout_s``; the message
            names each, its ask, and every node's total and free resources.
    """
    refs = [ref for _, ref in started]
    deadline = clock() + timeout_s
    pending = list(refs)
    while pending:
        left = deadline - clock()
        if left <= 0:
            break
        _, pending = wait(pending, left)
    if not pending:
        return
    waiting = {id(ref) for ref in pending}
    names = "; ".join(f"{ask.name} asks for {_fmt(ask.resources)}"
                      for ask, ref in started if id(ref) in waiting)
    raise RayPlacementError(
        f"Ray has not started {names} within {timeout_s:g} s. What the nodes have:\n"
        f"{describe_nodes(nodes(), available())}\nEach ask fits some node alone, so the "
        "others took what it needs: free resources, lower the asks (the router's own "
        "num_cpus is router.num_cpus), or raise placement_timeout_s if the nodes are "
        "still starting.")
