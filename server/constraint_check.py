"""The safety net under the grammar: every finished ``json_schema`` output is validated with
``jsonschema`` (the draft the schema declares, 2020-12 by default; ``format`` is an annotation,
as the spec has it) before it reaches the client.

A violation means a backend let through what it should have refused: it is logged with the
schema's hash, counted in ``splitserve_constraint_violations_total{backend}`` (the backend the
workers report they compiled it with, ``messages.TokenOutput.grammar_backend``), and under
``strict`` the request fails (500, ``constraint_violation``) instead of answering a
valid-looking 200. Outputs cut by ``max_tokens`` are not finished, so they are not checked.
A reasoning model's output is checked after its thinking, where its grammar starts
(``engine.grammar.think``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import jsonschema

from splitserve.server.constraints import constraint_plan
from splitserve.server.errors import APIError
from splitserve.server.generation import Piece
from splitserve.server.job import Job
from splitserve.server.offload import Offload

logger = logging.getLogger(__name__)

PARTIAL_HEADER = "x-splitserve-constraint"


def schema_hash(text: str) -> str:
    """Returns: the first 16 hex digits of the SHA-256 of the schema text (a log key)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def partial_header(job: Job) -> dict[str, str]:
    """The partial-constraint header of ``job``'s ``json_schema`` answer.

    What the workers reported they compiled (``Job.grammar_backend``, ``Job.grammar_ignored``:
    recorded with the first token), when a report came; before one (a header that must go out
    before the first token, a worker that predates the report) the plan's prediction
    (``constraint_plan(...).best_partial()``).

    Returns:
        ``{PARTIAL_HEADER: "partial; ignored=..."}`` (the ignored keywords, ``keyword@/pointer``,
        comma-separated) when some keyword is not enforced, else ``{}``.
    """
    constraint = job.sampling.constraint
    if constraint is None or constraint.kind != "json_schema":
        return {}
    ignored = (job.grammar_ignored if job.grammar_backend else
               constraint_plan(constraint).best_partial())
    if not ignored:
        return {}
    names = ",".join(item.replace(" at ", "@") for item in ignored)
    return {PARTIAL_HEADER: f"partial; ignored={names}"}


def violation(schema_text: str, output: str) -> str | None:
    """Check one finished output.

    Args:
        schema_text: the schema as JSON.
        output: the generated text.

    Returns:
        None when ``output`` is JSON that validates, else what is wrong (first error).
    """
    schema = json.loads(schema_text)
    try:
        instance = json.loads(output)
    except ValueError as exc:
        return f"not JSON: {exc}"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(schema).iter_errors(instance))
    if error is None:
        return None
    return f"{error.message} at /{'/'.join(str(p) for p in error.absolute_path)}"


def checked_pieces(
    job: Job, pieces: AsyncIterator[Piece], violations: Any | None, offload: Offload | None = None
) -> AsyncIterator[Piece]:
    """``pieces``, with the last one held until the whole output has been validated (the same
    iterator when there is nothing to validate).

    Args:
        job: the job the pieces belong to.
        pieces: from ``server.generation.stream_text``.
        violations: a Prometheus counter with a ``backend`` label, or None.
        offload: where ``jsonschema`` runs, off the event loop (None: inline).

    Raises:
        APIError: 500 ``constraint_violation`` when a strict schema's output does not validate.
    """
    constraint = job.sampling.constraint
    # A stop string may cut the JSON short of its end; such an output is not finished.
    if constraint is None or constraint.kind != "json_schema" or job.stop:
        return pieces
    return _validated(job, constraint, pieces, violations, offload)


async def _validated(
    job: Job, constraint: Any, pieces: AsyncIterator[Piece], violations: Any | None,
    offload: Offload | None,
) -> AsyncIterator[Piece]:
    parts: list[str] = []
    try:
        async for piece in pieces:
            parts.append(piece.text)
            if piece.finish_reason == "stop":
                output = "".join(parts)
                if job.reasoning is not None:  # the schema holds after the thinking
                    output = job.reasoning.split(output)[1]
                problem = (violation(constraint.text, output) if offload is None else
                           await offload.run(violation, constraint.text, output))
                _check(job, constraint, problem, violations)
            yield piece
    finally:
        await pieces.aclose()  # type: ignore[attr-defined]


def violating_backend(job: Job) -> str:
    """The backend a violation of ``job``'s schema is counted under: the one the workers
    reported compiling it (``Job.grammar_backend``); without a report, the one the plan
    expects (the first sound step, or for a partial plan the step that ignores keywords;
    "none" when the plan has no step)."""
    if job.grammar_backend:
        return job.grammar_backend
    plan = constraint_plan(job.sampling.constraint)
    partial = next((step for step in plan.steps if step.ignored), None)
    chosen = partial if not plan.sound and partial is not None else (
        plan.steps[0] if plan.steps else None)
    return chosen.backend if chosen is not None else "none"


def _check(job: Job, constraint: Any, problem: str | None, violations: Any | None) -> None:
    if problem is None:
        return
    backend = violating_backend(job)
    logger.error("constraint violation: request %s, schema %s, backend %s: %s",
                 job.rid, schema_hash(constraint.text), backend, problem)
    if violations is not None:
        violations.labels(backend).inc()
    if constraint.strict:
        raise APIError(
            f"the output broke its strict json_schema ({problem}); this is a bug in the grammar "
            "backend, logged with the schema's hash",
            status_code=500, code="constraint_violation",
        )
