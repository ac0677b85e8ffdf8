"""Run by ``test_without_torch.py`` in a fresh interpreter where torch cannot be imported: build
the API server's app as ``server/main.py`` does (tokenizer, chat renderer, metrics, guard,
CORS), on the fake engine client, and answer requests that walk the request validation (a
plain chat, a ``strict`` JSON schema no backend enforces, the same schema best effort, a tool
call). Prints one JSON line: each answer's status and headers of interest, and every module of
``splitserve.engine`` that got imported.

Usage: ``python app_without_torch.py MODEL_FOLDER``.
"""

from __future__ import annotations

import json
import sys

# The import system's own "not installed" marker: ``import torch`` (and ``import torch.nn``)
# raises ModuleNotFoundError and ``importlib.util.find_spec("torch")`` answers None, so a
# library that probes for torch (transformers) runs its torch-free path, as on a machine
# without torch.
sys.modules["torch"] = None  # type: ignore[assignment]

from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from splitserve.server.chat_template import ChatRenderer
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.main import create_app, install_cors
from splitserve.server.metrics import ServerMetrics, install_metrics
from splitserve.server.tenancy import KeyRing, Tenancy

MODEL = "smol-test"
USER = [{"role": "user", "content": "Say hi"}]
UNIQUE = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]


def main(model_folder: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    eos = [tokenizer.eos_token_id]
    fake = FakeEngineClient(tokenizer, eos_token_id=eos[0])
    metrics = ServerMetrics()
    app = create_app(fake, tokenizer, MODEL, 2048, eos, chat=ChatRenderer(tokenizer),
                     tenancy=Tenancy(), metrics=metrics)
    install_metrics(app, metrics)
    install_guard(app, KeyRing.from_config(None, None), 1 << 20)
    install_cors(app, [])
    bodies = {
        "chat": {"messages": USER},
        "strict_refused": {"messages": USER, "response_format": {"type": "json_schema",
                           "json_schema": {"name": "t", "strict": True, "schema": UNIQUE}}},
        "best_effort": {"messages": USER, "response_format": {"type": "json_schema",
                        "json_schema": {"name": "t", "schema": UNIQUE}}},
        "tools": {"messages": USER, "tools": TOOLS, "tool_choice": "required"},
    }
    answers = {}
    with TestClient(app) as client:
        for name, body in bodies.items():
            r = client.post("/v1/chat/completions", json={"model": MODEL, **body})
            answers[name] = {"status": r.status_code, "body": r.json(),
                             "constraint": r.headers.get("x-splitserve-constraint")}
    engine = sorted(m for m in sys.modules if m.startswith("splitserve.engine"))
    print(json.dumps({"answers": answers, "engine_modules": engine,
                      "torch_blocked": sys.modules.get("torch", 0) is None}))


if __name__ == "__main__":
    main(sys.argv[1])
