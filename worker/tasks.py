"""A task as a worker takes it in: whether it can run here at all, and the scheduler's request
for it. Shared by every role's policy."""

from __future__ import annotations

import time

import msgspec

from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.messages import GenerateTask
from splitserve.radix_cache.namespace import adapter_namespace


def task_error(task: GenerateTask, scheduler: Scheduler, context_len: int) -> str | None:
    """Why ``task``'s prompt can never run on this worker (empty, past the model's context of
    ``context_len`` tokens, larger than the KV pool), or None when it can."""
    n = len(task.input_ids)
    if n == 0:
        return "prompt is empty"
    if n >= context_len:
        return f"prompt of {n} tokens exceeds the model context of {context_len}"
    if not scheduler.fits_pool(n + 1):
        cap = (scheduler.allocator.num_pages - 1) * scheduler.page_size
        return f"prompt of {n} tokens does not fit the KV pool ({cap} tokens)"
    if task.lora is not None and (scheduler.lora is None
                                  or scheduler.lora.get(task.lora.name) is None):
        return f"model {task.lora.name!r}: the LoRA adapter is not loaded on this worker"
    return None


def new_req(task: GenerateTask, scheduler: Scheduler, stamp: str = "received") -> Req:
    """The scheduler's request for ``task``. Its output is capped at what the KV pool holds
    after the prompt: a sequence that outgrew the pool could never be re-admitted once
    retracted and would wedge the queue behind it. It then ends with ``length``, as at the
    model's context (only a pool smaller than the context can hit this). Under a LoRA adapter
    (loaded here: :func:`task_error` checked), its prefix-cache namespace is the adapter's
    within the tenant's (``radix_cache.namespace``). ``stamp``: the ``Req.stamps`` field that
    records its arrival here (``decode_received`` on a decode worker)."""
    lora = None
    if task.lora is not None and scheduler.lora is not None:
        lora = scheduler.lora.get(task.lora.name)
    sampling = task.sampling
    room = (scheduler.allocator.num_pages - 1) * scheduler.page_size - len(task.input_ids)
    if sampling.max_new_tokens > room:
        sampling = msgspec.structs.replace(sampling, max_new_tokens=max(room, 1))
    req = Req(
        rid=task.rid,
        input_ids=list(task.input_ids),
        sampling=sampling,
        reply_addr=task.reply_addr,
        cache_namespace=adapter_namespace(task.cache_namespace,
                                          None if lora is None else lora.digest),
        lora=lora,
    )
    setattr(req.stamps, stamp, time.time())
    return req
