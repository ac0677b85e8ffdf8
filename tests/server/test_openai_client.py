"""The openai client against the API served for real on the fake engine: chat, streamed chat
with usage, completions, the model list, and a 400 raised as BadRequestError."""

from __future__ import annotations

import pytest

from splitserve.server.fake_client import DEFAULT_REPLY
from tests.http_api import MODEL, USER


def test_openai_client(live_server) -> None:
    import openai

    api = openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    chat = api.chat.completions.create(model=MODEL, messages=USER, max_tokens=50)
    assert chat.choices[0].message.content == DEFAULT_REPLY
    assert chat.usage.prompt_tokens_details.cached_tokens == 0

    stream = api.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == DEFAULT_REPLY and chunks[-1].usage.completion_tokens > 0

    comp = api.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert comp.choices[0].finish_reason == "length"
    assert [m.id for m in api.models.list()] == [MODEL]

    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt="hi", temperature=9)
    assert info.value.body["param"] == "temperature"
