"""Everything one worker composes, as one plain object (built by ``worker.build.build_parts``
from the worker's config; by tests from fakes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.config import WorkerConfig
    from splitserve.engine.core import EngineCore
    from splitserve.engine.kv_pool import KVPool
    from splitserve.engine.lora.manager import LoraManager
    from splitserve.engine.model.config import ModelConfig
    from splitserve.engine.sched.scheduler import Scheduler
    from splitserve.ipc.messages import WeightsMsg
    from splitserve.kv_transfer.base import BaseKVReceiver, BaseKVSender
    from splitserve.kv_transfer.recv_session import RecvSessions
    from splitserve.kv_transfer.send_session import SendSessions
    from splitserve.worker.grammars import WorkerGrammars
    from splitserve.worker.links import Links
    from splitserve.worker.port import OutboxPort
    from splitserve.worker.tracing import WorkerTracer


@dataclass(slots=True, eq=False)
class WorkerParts:
    """The parts of one worker: the engine (``core``: its ``scheduler`` and model runner, over
    ``pool``), the grammar compiles, the sockets (``links``) and the port policies act through,
    and the KV transfer endpoint with its sessions: ``sender`` and send ``sessions`` on a
    prefill worker, ``receiver`` and receive ``sessions`` on a decode worker, none of them on a
    colocated one.

    ``dtype``: the dtype the model runs in (``float32``, ``bfloat16``...); ``weights``: the
    loaded weights' identity for the KV handshake; ``lora``: its LoRA adapters (None: it
    serves none).
    """

    config: WorkerConfig
    dtype: str
    model_config: ModelConfig
    weights: WeightsMsg
    pool: KVPool
    scheduler: Scheduler
    core: EngineCore
    grammars: WorkerGrammars
    links: Links
    port: OutboxPort
    sender: BaseKVSender | None = None
    receiver: BaseKVReceiver | None = None
    sessions: SendSessions | RecvSessions | None = None
    lora: LoraManager | None = None
    tracer: WorkerTracer | None = None  # spans of traced requests (None: tracing off)
