"""/v1/chat/completions, not streamed, on the fake engine: the answer's shape, the prompt the chat
template makes (no doubled BOS), text parts and the developer role, cached tokens in usage."""

from __future__ import annotations

from splitserve.server.fake_client import DEFAULT_REPLY
from tests.http_api import MODEL, USER


def test_chat(client, fake, tokenizer) -> None:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": DEFAULT_REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    input_ids = fake.requests[-1][1]
    assert input_ids == tokenizer.encode(text, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(input_ids)
    # The template's own BOS (if any) is not doubled by the encoder.
    bos = tokenizer.bos_token_id
    assert bos is None or input_ids[:2] != [bos, bos]


def test_chat_text_parts_and_developer_role(client, fake) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}],
        },
    ]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert (
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).status_code
        == 200
    )
    assert (
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": plain}).status_code
        == 200
    )
    assert fake.requests[0][1] == fake.requests[1][1]


def test_cached_tokens_reported(client) -> None:
    req = {"model": MODEL, "messages": USER}
    client.post("/v1/chat/completions", json=req)
    usage = client.post("/v1/chat/completions", json=req).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
