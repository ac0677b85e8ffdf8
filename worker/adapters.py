"""A worker's LoRA adapters as the loop sees them: loads on a thread, tasks held until their
adapter is loaded, and the router's load and unload messages.

Reading an adapter (its files, their checks, its weights laid out for the model:
``engine.lora.manager.LoraManager.read``) runs on one background thread, so the requests
already running keep decoding while it loads; the loop registers it when done
(:meth:`WorkerAdapters.poll`) and answers the router. A task whose adapter is not loaded here
(this worker restarted, or joined after the load) is held and its adapter loaded from the
folder the task names; a task whose adapter is loading waits for it. Either way the role's
policy only ever sees tasks it can run, in the order they came.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from splitserve.engine.lora.manager import LoadedAdapter, LoraManager
from splitserve.engine.lora.peft import LoraError
from splitserve.ipc.messages import (
    FailureKind,
    GenerateTask,
    LoadLora,
    LoraReply,
    UnloadLora,
)
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.worker.port import WorkerPort

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Load:
    """One adapter being read: who asked (routers' load messages) and the tasks waiting."""

    name: str
    path: str
    future: Future[LoadedAdapter]
    pinned: bool = False
    asked: list[LoadLora] = field(default_factory=list)
    tasks: list[GenerateTask] = field(default_factory=list)
    cancelled: bool = False  # unloaded while it was read: discarded when done


class WorkerAdapters:
    """The LoRA side of one worker's loop.

    Args:
        manager: the worker's adapters (None: this worker serves none, and refuses tasks and
            loads that name one).
        port: where replies and refusals go.
        worker_id: this worker's id (in replies).
    """

    def __init__(self, manager: LoraManager | None, port: WorkerPort, worker_id: str) -> None:
        self.manager = manager
        self.port = port
        self.worker_id = worker_id
        self.loads: dict[str, _Load] = {}
        self.unloaded: set[str] = set()  # unloaded since: a late task for one is refused
        self._pool: ThreadPoolExecutor | None = None

    # ---- the router's messages ------------------------------------------------------------------

    def on_load(self, msg: LoadLora) -> None:
        """Start reading ``msg``'s adapter (answered when done, :meth:`poll`)."""
        if self.manager is None:
            self._reply(msg, error="this server does not serve LoRA adapters: start it with "
                        "--enable-lora (or --lora-modules)")
            return
        self.unloaded.discard(msg.name)
        load = self._start(msg.name, msg.path, msg.pinned)
        load.asked.append(msg)

    def on_unload(self, msg: UnloadLora) -> None:
        """Forget ``msg``'s adapter now (requests admitted under it finish under it)."""
        if self.manager is None:
            self._reply(msg, error="this server does not serve LoRA adapters")
            return
        load = self.loads.get(msg.name)
        if load is not None:
            load.cancelled = True
        self.unloaded.add(msg.name)
        self.manager.unload(msg.name)
        self._reply(msg)

    # ---- tasks ----------------------------------------------------------------------------------

    def admit(self, task: GenerateTask) -> GenerateTask | None:
        """``task`` when it can run now (no adapter, or its adapter loaded from its folder);
        else None: it is held until its adapter loads (a load started from the task's folder
        if none runs), or refused (this worker serves no adapters, or it was unloaded)."""
        ref = task.lora
        if ref is None:
            return task
        if self.manager is None:
            self._refuse(task, f"model {ref.name!r}: this worker does not serve LoRA adapters")
            return None
        loaded = self.manager.get(ref.name)
        load = self.loads.get(ref.name)
        if load is None and loaded is not None and loaded.path == ref.path:
            return task
        if ref.name in self.unloaded:
            self._refuse(task, f"model {ref.name!r}: the adapter was unloaded")
            return None
        if load is None or load.path != ref.path or load.cancelled:
            load = self._start(ref.name, ref.path, pinned=False)
        load.tasks.append(task)
        return None

    def drop(self, rid: str) -> bool:
        """Forget a held task (aborted); False if ``rid`` is not held here."""
        for load in self.loads.values():
            for task in load.tasks:
                if task.rid == rid:
                    load.tasks.remove(task)
                    return True
        return False

    def held(self) -> dict[str, str]:
        """The held tasks: rid -> the router's inbox."""
        return {t.rid: t.reply_addr for load in self.loads.values() for t in load.tasks}

    def poll(self) -> list[GenerateTask]:
        """Register the adapters read since the last poll and answer who asked; returns the
        tasks that can run now, in the order they came (tasks whose adapter failed to load
        are refused with its problem)."""
        ready: list[GenerateTask] = []
        for name, load in list(self.loads.items()):
            if not load.future.done():
                continue
            del self.loads[name]
            error = self._register(load)
            for msg in load.asked:
                self._reply(msg, error, self.manager.get(name) if not error else None)
            for task in load.tasks:
                if error:
                    self._refuse(task, f"model {name!r}: {error}")
                else:
                    ready.append(task)
        return ready

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        return len(self.loads)

    # ---- helpers --------------------------------------------------------------------------------

    def _start(self, name: str, path: str, pinned: bool) -> _Load:
        load = self.loads.get(name)
        if load is not None and load.path == path and not load.cancelled:
            load.pinned = load.pinned or pinned
            return load
        assert self.manager is not None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        future = self._pool.submit(self.manager.read, name, path)
        new = _Load(name, path, future, pinned)
        if load is not None:  # another folder or an unloaded one: its waiters follow this one
            new.asked, new.tasks = load.asked, load.tasks
        self.loads[name] = new
        return new

    def _register(self, load: _Load) -> str:
        """Register a finished read; returns "" or why it failed."""
        assert self.manager is not None
        if load.cancelled:
            return "the adapter was unloaded while it loaded"
        try:
            adapter = load.future.result()
            self.manager.add(adapter, load.pinned)
        except LoraError as exc:
            return str(exc)
        except Exception as exc:  # a bug must fail the load, not the worker
            logger.exception("loading LoRA adapter %s from %s failed", load.name, load.path)
            return f"loading failed: {exc}"
        logger.info("LoRA adapter %s loaded from %s: rank %d, %.1f MB, %.0f ms", load.name,
                    load.path, adapter.rank, adapter.weights.nbytes / 1e6, adapter.load_s * 1e3)
        return ""

    def _reply(self, msg: LoadLora | UnloadLora, error: str = "",
               adapter: LoadedAdapter | None = None) -> None:
        reply = LoraReply(query_id=msg.query_id, worker_id=self.worker_id, name=msg.name,
                          error=error)
        if adapter is not None:
            reply.digest, reply.rank, reply.load_s = adapter.digest, adapter.rank, adapter.load_s
        try:
            self.port.send(msg.reply_addr, reply)
        except PeerUnreachable as exc:
            logger.warning("LoRA reply for %s not delivered: %s", msg.name, exc)

    def _refuse(self, task: GenerateTask, message: str) -> None:
        self.port.fail(task.rid, task.reply_addr, message, 400, FailureKind.INVALID)
