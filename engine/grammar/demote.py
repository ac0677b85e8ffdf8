"""Lowering the CPU priority of threads that run a long grammar compile.

A compile that has run past ``CompilePool.long_after_s`` is treated as pathological: it may go
on until its deadline, but only on CPU time nobody else wants, so that ordinary compiles and
the model's steps keep their speed on a small host. Linux's priority is per thread: setting
it on a process id changes only its main thread, and xgrammar compiles on threads it starts
per compile. So the threads are demoted one by one (``/proc/self/task``), and a thread started
later by a demoted thread inherits its policy.

Only lowering is done: raising a thread's priority back needs privileges (``RLIMIT_NICE``) an
ordinary user lacks, so a demoted thread is never reused for a normal compile (each compile
runs on a fresh thread, see ``compile_pool``). Where ``SCHED_IDLE`` is unavailable (not
Linux) ``nice`` 19 is used; where neither is, nothing changes.
"""

from __future__ import annotations

import os

IDLE_NICE = 19


def own_thread_ids() -> set[int]:
    """Kernel thread ids (``native_id``) of this process's threads; empty where ``/proc`` is
    missing."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def demote_thread(tid: int, idle_class: bool = True) -> bool:
    """Move kernel thread ``tid`` (0: the calling thread) to ``SCHED_IDLE`` (``idle_class``)
    or to nice 19.

    Returns: whether its priority was lowered (False: the thread is gone, or the platform has
    neither call).
    """
    if idle_class and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return True
        except OSError:
            pass  # gone, or not permitted: try nice
    try:
        os.setpriority(os.PRIO_PROCESS, tid, IDLE_NICE)
        return True
    except (OSError, AttributeError):
        return False


def is_demoted(tid: int) -> bool:
    """Whether kernel thread ``tid`` runs at ``SCHED_IDLE`` or nice 19 (for tests and logs).

    Raises:
        OSError: no such thread.
    """
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is not None and hasattr(os, "sched_getscheduler") and os.sched_getscheduler(tid) == idle:
        return True
    return os.getpriority(os.PRIO_PROCESS, tid) >= IDLE_NICE
