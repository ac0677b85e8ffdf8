"""The API server's request path imports neither torch nor the engine: a fresh interpreter where
``import torch`` raises builds the app as ``server/main.py`` does (on the fake engine client) and
answers requests that go through request validation, including the constraint planning
(``splitserve.constraints``: which backend enforces which keyword, ``strict`` refusal)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("app_without_torch.py")


def test_app_answers_with_torch_blocked(model_path: Path) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), str(model_path)], check=False,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["torch_blocked"], "something replaced the blocked torch module"
    assert result["engine_modules"] == []
    answers = result["answers"]
    assert answers["chat"]["status"] == 200, answers["chat"]
    assert answers["chat"]["body"]["choices"][0]["finish_reason"] == "stop"
    refused = answers["strict_refused"]
    assert refused["status"] == 400 and refused["body"]["error"]["param"] == "response_format"
    assert "uniqueItems" in refused["body"]["error"]["message"]
    partial = answers["best_effort"]
    assert partial["status"] == 200 and partial["constraint"].startswith("partial")
    assert answers["tools"]["status"] == 200, answers["tools"]
