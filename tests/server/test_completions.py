"""/v1/completions, not streamed, on the fake engine: the answer's shape and usage, the default
token budget (the rest of the context), and prompts given as token ids."""

from __future__ import annotations

from splitserve.server.fake_client import DEFAULT_REPLY
from tests.http_api import CONTEXT_LEN, MODEL


def test_completion(client, fake, tokenizer) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon"})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": DEFAULT_REPLY, "finish_reason": "stop", "logprobs": None}
    ]
    prompt_len = len(tokenizer.encode("Once upon"))
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": len(fake.reply_ids) + 1,  # + EOS
        "total_tokens": prompt_len + len(fake.reply_ids) + 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    _, _, sampling = fake.requests[-1]
    assert sampling.max_new_tokens == CONTEXT_LEN - prompt_len  # default: the rest of context
    assert sampling.stop_token_ids == [tokenizer.eos_token_id]


def test_completion_token_id_prompts(client, fake) -> None:
    for prompt in ([10, 20, 30], [[10, 20, 30]], ["hi"]):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 200, r.text
    assert fake.requests[0][1] == [10, 20, 30] == fake.requests[1][1]
