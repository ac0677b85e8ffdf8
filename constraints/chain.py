"""The backend chain for one constraint: which backends may compile it, in which order, and
what each would leave unenforced.

Soundness first: a ``json_schema`` goes to the first backend (in the configured order) that
enforces every feature of it (``schema_limits.ignored_keywords`` empty); a backend known to
refuse the schema is skipped without compiling. Under ``strict`` only those sound backends run;
none -> the caller refuses the request, naming each keyword and where it sits. Without
``strict``, the unsound backends follow, the one that ignores the fewest keywords first, and the
grammar records what it ignores (``CompiledGrammar.ignored``); they also follow the sound ones,
for a schema a sound backend fails to compile for another reason. Other kinds have no keyword
limits: every backend in order.

A ``json_schema`` is first rewritten into keywords more backends enforce, keeping its valid
instances the same (``schema_rewrite.exact_rewrite``: disjoint ``oneOf`` as ``anyOf``,
dependencies as ``anyOf``, unknown formats dropped); the plan measures and compiles that text
(``ChainPlan.source``), while outputs are still validated against the request's schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.constraints.schema_limits import (
    ignored_keywords,
    known_refusals,
    refused_keywords,
)
from splitserve.constraints.schema_rewrite import exact_rewrite


@dataclass(frozen=True, slots=True)
class ChainStep:
    """One backend to try, what it would not enforce (``"keyword at /pointer"``), and the text
    it compiles when that is not the plan's ``source`` (the request's own schema, for the last
    fallbacks after a rewrite)."""

    backend: str
    ignored: tuple[str, ...] = ()
    source: str | None = None


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """The steps to try in order, and ``ignored_by_all``: per backend, what it ignores or is
    known to refuse, when no backend is known to compile and enforce all of it (empty
    otherwise; a backend that refuses by itself may still be among the steps and compile it),
    and ``source``: the constraint text the steps compile (for ``json_schema``, the exact
    rewrite of the request's schema)."""

    steps: tuple[ChainStep, ...]
    ignored_by_all: dict[str, tuple[str, ...]]
    source: str

    @property
    def sound(self) -> bool:
        """True when some backend may enforce the whole constraint."""
        return not self.ignored_by_all

    def best_partial(self) -> tuple[str, ...]:
        """Returns: what the first unsound step ignores when no backend is known to enforce the
        whole schema (the response's ``partial`` header), else empty."""
        if not self.ignored_by_all:
            return ()
        return next((step.ignored for step in self.steps if step.ignored), ())


def plan_chain(
    kind: str, text: str, backends: Sequence[str], strict: bool = False
) -> ChainPlan:
    """Order ``backends`` for one constraint.

    Args:
        kind: a grammar kind; only ``json_schema`` has keyword limits.
        text: the constraint source (the schema as JSON for ``json_schema``).
        backends: backend names in the configured order.
        strict: keep only backends that enforce the whole schema.

    Returns:
        The plan. Its steps are empty when ``strict`` and no backend is sound; a schema that is
        not valid JSON gets every backend (each one reports the syntax error).
    """
    if kind != "json_schema":
        return ChainPlan(tuple(ChainStep(b) for b in backends), {}, text)
    try:
        original = json.loads(text)
    except ValueError:
        return ChainPlan(tuple(ChainStep(b) for b in backends), {}, text)
    schema = exact_rewrite(original)
    source = text if schema is original else json.dumps(schema)
    sound, unsound, unenforced = _classify(schema, backends)
    # Statically, some backend compiles and enforces all of it: nothing to report.
    clean = any(not items for items in unenforced.values())
    ignored_by_all = {} if clean else unenforced
    if strict:
        return ChainPlan(tuple(sound), ignored_by_all, source)
    # After the sound ones (one may still fail to compile: a regex feature, a timeout), the
    # unsound ones, fewest ignored keywords first (stable: configured order among ties). After
    # a rewrite, the fallbacks compile the request's own schema: the rewrite's spelling is for
    # the backends it makes sound, and others may compile the original where not the rewrite.
    if schema is original:
        return ChainPlan(tuple(sound + unsound), ignored_by_all, source)
    sound_before, unsound_before, _ = _classify(original, backends)
    tried = {step.backend for step in sound}
    fallbacks = [ChainStep(step.backend, step.ignored, text)
                 for step in sound_before + unsound_before if step.backend not in tried]
    return ChainPlan(tuple(sound + fallbacks), ignored_by_all, source)


def _classify(
    schema: Any, backends: Sequence[str]
) -> tuple[list[ChainStep], list[ChainStep], dict[str, tuple[str, ...]]]:
    """Returns: the sound steps in configured order, the unsound ones (fewest ignored keywords
    first), and per backend what it ignores or is known to refuse."""
    sound, unsound = [], []
    unenforced: dict[str, tuple[str, ...]] = {}
    for name in backends:
        ignored = tuple(ignored_keywords(name, schema))
        refused = tuple(f"{item} (refused)" for item in known_refusals(name, schema))
        unenforced[name] = ignored + refused
        if ignored:
            unsound.append(ChainStep(name, ignored))
        elif not refused_keywords(name, schema):  # refuses_itself backends are tried
            sound.append(ChainStep(name))
    unsound.sort(key=lambda step: len(step.ignored))
    return sound, unsound, unenforced
