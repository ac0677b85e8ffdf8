"""``splitserve demo``: start a disaggregated cluster on the default model, send real chat and
completion requests through the ``openai`` client, print each answer with its TTFT, stop."""

from __future__ import annotations

import time

from splitserve.config import ServeConfig
from splitserve.launch.local import Cluster

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
]
COMPLETIONS = ["The three primary colors are", "def fibonacci(n):"]


def _stream(client, model: str, **kwargs) -> tuple[str, float, float, int]:
    t0 = time.perf_counter()
    ttft, text, n = None, [], 0
    if "messages" in kwargs:
        stream = client.chat.completions.create(model=model, stream=True, **kwargs)
        for chunk in stream:
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                ttft = ttft or time.perf_counter() - t0
                text.append(piece)
                n += 1
    else:
        stream = client.completions.create(model=model, stream=True, **kwargs)
        for chunk in stream:
            piece = chunk.choices[0].text if chunk.choices else None
            if piece:
                ttft = ttft or time.perf_counter() - t0
                text.append(piece)
                n += 1
    return "".join(text), (ttft or 0.0), time.perf_counter() - t0, n


def run_demo(config: ServeConfig) -> None:
    from openai import OpenAI

    c = config.cluster
    print(f"starting {c.num_prefill} prefill + {c.num_decode} decode workers on {config.url} ...")
    t0 = time.perf_counter()
    with Cluster(config):
        print(f"cluster ready in {time.perf_counter() - t0:.1f} s\n")
        client = OpenAI(base_url=config.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        for q in CHATS:
            text, ttft, total, _ = _stream(
                client, model, messages=[{"role": "user", "content": q}], max_tokens=64,
                temperature=0,
            )
            print(f"[chat] {q}\n  -> {text.strip()}\n  TTFT {ttft * 1000:.0f} ms, total {total:.2f} s\n")
        for p in COMPLETIONS:
            text, ttft, total, _ = _stream(client, model, prompt=p, max_tokens=32, temperature=0)
            print(f"[completion] {p!r}\n  -> {text!r}\n  TTFT {ttft * 1000:.0f} ms, total {total:.2f} s\n")
    print("cluster stopped.")
