"""``@function`` programs: ``run``, ``run_batch`` and ``trace``."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from splitserve.lang.backend import BaseBackend, SamplingArgs
from splitserve.lang.errors import ProgramError
from splitserve.lang.prefix import warm_shared_prefix
from splitserve.lang.state import ProgramState, RunContext
from splitserve.lang.tracer import Trace, trace

_default_backend: BaseBackend | None = None  # configuration, like logging's root level


def set_default_backend(backend: BaseBackend | None) -> None:
    """The backend programs use when ``run`` is not given one."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> BaseBackend:
    """Raises RuntimeError when none was set."""
    if _default_backend is None:
        raise RuntimeError("no backend: call lang.set_default_backend(lang.Endpoint(url)) or "
                           "pass backend=... to run")
    return _default_backend


class Program:
    """A prompt program: ``def prog(s, ...)`` decorated with ``@function``."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.name = func.__name__
        functools.update_wrapper(self, func)

    def __call__(self, s: Any, *args: Any, **kwargs: Any) -> Any:
        """Call inside another program: ``sub(s, ...)`` appends to that program's state."""
        return self.func(s, *args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Trace:
        """The program's IR for these arguments, without calling a model."""
        return trace(self.func, *args, **kwargs)

    def _warmup_trace(self, kwargs: dict[str, Any]) -> Trace | None:
        """The item's trace, or None when the program raised before using any model output:
        its run reports that error in its slot; the warm-up only leaves the item out."""
        try:
            return self.trace(**kwargs)
        except Exception:  # noqa: BLE001 - the item's own run raises it again, where it is reported
            return None

    def run(
        self,
        *args: Any,
        backend: BaseBackend | None = None,
        stream: bool = False,
        max_tokens: int = 128,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program. ``max_tokens``/``temperature``/``top_p``/``seed`` are the defaults
        of every ``gen`` that does not set its own.

        With ``stream=True`` the program runs in a thread and the state returns at once: read
        it with ``text_iter()``, which raises the program's error at the end.

        Raises:
            ProgramError: a step failed (which step, of which branch) or the program raised.
        """
        ctx = RunContext(backend or get_default_backend(), self.name,
                         SamplingArgs(max_tokens, None, temperature, top_p, seed), stream)
        state = ProgramState(ctx)
        if stream:
            threading.Thread(target=self._run_in, args=(ctx, state, args, kwargs, False),
                             daemon=True, name=f"lang-{self.name}").start()
            return state
        self._run_in(ctx, state, args, kwargs, True)
        return state

    def _run_in(self, ctx: RunContext, state: ProgramState, args: tuple, kwargs: dict,
                reraise: bool) -> None:
        try:
            ctx.return_value = self.func(state, *args, **kwargs)
            for st in list(ctx.states):  # branches nobody read may still hold a failure
                st._sync()
        except ProgramError as err:
            ctx.error = err
        except Exception as exc:  # noqa: BLE001 - the program's own code failed between steps
            err = ProgramError(self.name, f"the program raised {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            ctx.error = err
        finally:
            ctx.done.set()
            for st in list(ctx.states):
                with st._cond:
                    st._cond.notify_all()
        if reraise and ctx.error is not None:
            raise ctx.error

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: BaseBackend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        warm_prefix: bool = True,
        **run_kwargs: Any,
    ) -> list[ProgramState | ProgramError]:
        """Run the program once per kwargs dict, in parallel; results keep the input order.

        A failing item yields its :class:`ProgramError` (with ``batch_index``) in its slot; the
        others are unaffected. With ``warm_prefix`` the text every item starts with (found by
        tracing them; a trace stops at the first data-dependent operation) is sent once first, so
        the prefix cache serves it to all. The warm-up only prefills: it never changes an output
        and never fails an item.
        """
        backend = backend or get_default_backend()
        if not batch_kwargs:
            return []
        if warm_prefix and len(batch_kwargs) > 1:
            warm_shared_prefix(backend, [t for t in map(self._warmup_trace, batch_kwargs) if t])
        threads = min(32, len(batch_kwargs)) if num_threads == "auto" else int(num_threads)
        results: list[ProgramState | ProgramError | None] = [None] * len(batch_kwargs)
        bar = _progress(len(batch_kwargs), self.name) if progress_bar else None

        def one(i: int) -> None:
            try:
                results[i] = self.run(backend=backend, **run_kwargs, **batch_kwargs[i])
            except ProgramError as err:
                results[i] = err.with_batch_index(i)
            if bar is not None:
                bar.update(1)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(one, range(len(batch_kwargs))))
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]


def _progress(total: int, name: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=name)


def function(func: Callable[..., Any]) -> Program:
    """Make ``def prog(s, ...)`` a :class:`Program`."""
    return Program(func)
