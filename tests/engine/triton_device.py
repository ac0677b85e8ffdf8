"""Where the Triton kernel tests run; import it before anything that imports our kernels.

On CUDA the compiled kernels run. Without CUDA they run under Triton's CPU interpreter, which
Triton picks when a kernel is decorated: so ``TRITON_INTERPRET=1`` is set here, at import, before
the kernels' modules are imported. A module importing this is skipped where neither can run (no
CUDA and ``TRITON_INTERPRET`` set to something else, or no Triton).
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)
pytest.importorskip("triton", reason="Triton is not installed")
