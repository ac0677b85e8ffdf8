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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.engine.grammar.schema_limits import ignored_keywords, refused_keywords


@dataclass(frozen=True, slots=True)
class ChainStep:
    """One backend to try and what it would not enforce (``"keyword at /pointer"``)."""

    backend: str
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """The steps to try in order, and ``ignored_by_all``: per backend that would compile the
    schema, what it ignores, when no backend enforces all of it (empty otherwise)."""

    steps: tuple[ChainStep, ...]
    ignored_by_all: dict[str, tuple[str, ...]]

    @property
    def sound(self) -> bool:
        """True when some backend may enforce the whole constraint."""
        return not self.ignored_by_all

    def best_partial(self) -> tuple[str, ...]:
        """Returns: what the best unsound backend ignores (empty when the plan is sound)."""
        if not self.ignored_by_all:
            return ()
        return min(self.ignored_by_all.values(), key=len)


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
        return ChainPlan(tuple(ChainStep(b) for b in backends), {})
    try:
        schema = json.loads(text)
    except ValueError:
        return ChainPlan(tuple(ChainStep(b) for b in backends), {})
    sound, unsound = [], []
    for name in backends:
        ignored = tuple(ignored_keywords(name, schema))
        if ignored:
            unsound.append(ChainStep(name, ignored))
        elif not refused_keywords(name, schema):
            sound.append(ChainStep(name))
    ignored_by_all = {} if sound else {step.backend: step.ignored for step in unsound}
    if strict:
        return ChainPlan(tuple(sound), ignored_by_all)
    # After the sound ones (one may still fail to compile: a regex feature, a timeout), the
    # unsound ones, fewest ignored keywords first (stable: configured order among ties).
    unsound.sort(key=lambda step: len(step.ignored))
    return ChainPlan(tuple(sound + unsound), ignored_by_all)
