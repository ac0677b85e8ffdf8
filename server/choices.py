"""``n`` > 1: one prompt's choices as sibling jobs that compute the prompt once.

A request with ``n`` gives each prompt ``n`` jobs (:func:`fork_choices`). They are independent
samples: each has its own rid on the workers, its own seed stream (:func:`choice_seed`), its
own stop strings, penalties, grammar matcher, logprobs and tool-call parse, and its own
``finish_reason``. What they share is the prompt:

- The first job (the lead) runs at once; the others wait until its first token is out
  (``PromptShare.ready``, set by ``server.generation.stream_text``). By then the worker that
  computed the prompt has put its full pages into its radix cache, and the siblings are sent to
  that same worker (``PromptAffinity``). Each sibling matches the prompt there and computes only
  the tokens past the prompt's last full page (at least one, whose logits it samples from:
  fewer than ``page_size + 1``), under its own seed.
- Colocated, the siblings then decode over the same full prompt pages as the lead: the radix
  tree lends them, locked, to every sibling; only the last partial page is each sibling's own.
- Disaggregated, the prompt is computed once on the prefill worker as above, but each sibling is
  a handoff of its own: the decode side reserves pages for it and the whole prompt's KV is
  transferred once per choice (``n`` transfers, ``n`` copies of the prompt's pages on the decode
  worker). Forking on the decode side over reference-counted pages is not built.
- Where the cache cannot serve it (``--prefix-cache none``, or the lead's entry evicted under
  page pressure before a sibling is admitted), a sibling computes the prompt itself: the
  outputs are the same, only the work is repeated.

``usage`` counts the prompt once per prompt (the lead's ``prompt_tokens`` and
``cached_tokens``) and the completion tokens of every choice. An abort of the request (client
gone, an error in any choice) closes every sibling's stream, which aborts it on the workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import anyio
import msgspec

from splitserve.ipc.messages import SamplingParams
from splitserve.server.engine_client import PromptAffinity
from splitserve.server.formatter import Usage
from splitserve.server.job import Job

_SEED_SPACE = 2**63  # derived seeds are non-negative and fit the wire's signed 64 bits


@dataclass(slots=True)
class PromptShare:
    """What the choices of one prompt share: the lead job, the event set once the lead's
    first token is out (or the lead ended without one), and where its prompt was computed."""

    lead: Job
    ready: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    affinity: PromptAffinity = dataclasses.field(default_factory=PromptAffinity)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request with ``seed``.

    Choice 0 uses ``seed`` itself, so it is the sample a request with ``n`` = 1 and the same seed
    gets. Choice ``i`` > 0 uses the first 8 bytes of BLAKE2b over ``"<seed>:<i>"``, modulo
    2**63: deterministic, so the same request gives the same ``n`` samples on any worker and
    in either mode, and not ``seed + i``, so requests with neighbouring seeds share no samples.
    Without a seed every choice is unseeded (independent random streams).
    """
    if seed is None:
        return None
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _SEED_SPACE


def fork_choices(job: Job, n: int, prompt_index: int) -> list[Job]:
    """The ``n`` choice jobs of ``job`` (a prompt's job, built and put in its tenant's namespace),
    with ``index`` ``prompt_index * n + i`` (OpenAI's order for several prompts). ``n`` = 1:
    ``job`` alone. Choice ``i`` has rid ``<job.rid>-<i>``, its own seed (:func:`choice_seed`),
    fresh output state, and ``job``'s tenant, namespace and ``on_tokens`` (the rate limiter
    admitted the prompt once and charges each choice's generated tokens)."""
    if n == 1:
        job.index = prompt_index
        return [job]
    share = PromptShare(job)
    choices = []
    for i in range(n):
        sampling = _choice_sampling(job.sampling, i)
        fields = {"rid": f"{job.rid}-{i}", "sampling": sampling, "index": prompt_index * n + i,
                  "share": share}
        if i == 0:
            for name, value in fields.items():
                setattr(job, name, value)
            choices.append(job)
            continue
        choices.append(dataclasses.replace(
            job, **fields, usage=Usage(job.usage.prompt_tokens), output_ids=[],
            output_logprobs=[], output_top_ids=[], output_top_logprobs=[]))
    return choices


def summed_usage(jobs: list[Job]) -> Usage:
    """The usage of one answer made of ``jobs``: each prompt's tokens (and cached tokens) once,
    from the job that leads it; the generated tokens of every choice."""
    total = Usage(0)
    for job in jobs:
        if job.leads_prompt:
            total.prompt_tokens += job.usage.prompt_tokens
            total.cached_tokens += job.usage.cached_tokens
            for tier, n in job.usage.cached_by_tier.items():
                total.cached_by_tier[tier] = total.cached_by_tier.get(tier, 0) + n
        total.completion_tokens += job.usage.completion_tokens
    return total


def prompt_source(job: Job) -> Job:
    """The job whose engine events carry ``job``'s prompt logprobs: its lead, for a sibling."""
    return job if job.share is None else job.share.lead


def _choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: its seed, and no prompt scoring for a sibling: the lead
    scores the prompt (echo + logprobs) and the siblings' answers read its scores
    (:func:`prompt_source`), so the prompt stays cacheable for them."""
    changes: dict[str, object] = {}
    if sampling.seed is not None:
        changes["seed"] = choice_seed(sampling.seed, index)
    if index > 0 and sampling.wants_prompt_logprobs:
        changes["logprob_start_len"] = -1
    return msgspec.structs.replace(sampling, **changes) if changes else sampling
