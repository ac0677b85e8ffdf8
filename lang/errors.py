"""Errors that say which step of which program failed."""

from __future__ import annotations


class BackendError(RuntimeError):
    """A backend could not serve a step: the server is down, answered an error, or lacks a
    feature the step needs (``unsupported`` is then True: no fallback is attempted)."""

    def __init__(self, message: str, *, status_code: int | None = None,
                 unsupported: bool = False) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.unsupported = unsupported


class ProgramError(RuntimeError):
    """A program failed.

    Attributes:
        program: the program's name.
        step_index: index of the failing node in its state's node list (None: the program's own
            Python code raised between steps).
        step: the failing node's label (``gen 'answer'``), or None.
        branch: ``""`` for the main state, else which fork branch (``fork@3[1]``).
        batch_index: position in ``run_batch``'s input, when it came from there.
    """

    def __init__(self, program: str, message: str, *, step_index: int | None = None,
                 step: str | None = None, branch: str = "") -> None:
        self.program = program
        self.step_index = step_index
        self.step = step
        self.branch = branch
        self.batch_index: int | None = None
        self.detail = message
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"program {self.program!r}"
        if self.batch_index is not None:
            where += f" (batch item {self.batch_index})"
        if self.branch:
            where += f" branch {self.branch}"
        if self.step_index is not None:
            where += f", step {self.step_index} ({self.step})"
        return f"{where} failed: {self.detail}"

    def with_batch_index(self, index: int) -> ProgramError:
        self.batch_index = index
        self.args = (self._render(),)
        return self

    def __str__(self) -> str:
        return self._render()
