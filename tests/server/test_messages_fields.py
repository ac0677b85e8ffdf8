"""The Messages field tables (``server.messages_api.fields``) against the ``anthropic`` SDK's own
request types (what its clients can send), and docs/api.md's copy against the tables."""

from __future__ import annotations

import typing

import anthropic.types as at
import pytest
from anthropic.types import beta as bt
from anthropic.types import message_count_tokens_params, message_create_params
from anthropic.types.beta import message_count_tokens_params as beta_count_tokens_params
from anthropic.types.beta import message_create_params as beta_create_params

from splitserve.server.messages_api.fields import (
    COUNT_TOKENS_FIELDS,
    MESSAGES_FIELDS,
    MESSAGES_NESTED,
    markdown_table,
)
from tests.doc_section import generated_section

# Anthropic documents these (its API reference's sampling parameters), but its SDK's request
# types no longer carry them: clients send them as extra body fields.
DOCUMENTED_OUTSIDE_THE_SDK = {"temperature", "top_p", "top_k"}
# Beta fields (the SDK's ``client.beta.messages``) served because Claude Code sends them.
SERVED_BETA = {"context_management"}


def _fields(*types: typing.Any) -> set[str]:
    """The keys of the TypedDicts ``types`` (a Union counts as its members)."""
    out: set[str] = set()
    for tp in types:
        for member in typing.get_args(tp) or (tp,):
            out |= set(typing.get_type_hints(member))
    return out


def test_top_level_fields_are_the_sdks() -> None:
    sdk = _fields(message_create_params.MessageCreateParamsBase,
                  message_create_params.MessageCreateParamsStreaming)
    assert set(MESSAGES_FIELDS) - sdk == DOCUMENTED_OUTSIDE_THE_SDK | SERVED_BETA
    assert sdk - set(MESSAGES_FIELDS) == set()
    assert SERVED_BETA <= _fields(beta_create_params.MessageCreateParamsBase)
    assert SERVED_BETA <= _fields(beta_count_tokens_params.MessageCountTokensParams)
    assert set(COUNT_TOKENS_FIELDS) == (
        _fields(message_count_tokens_params.MessageCountTokensParams) | SERVED_BETA)


SERVED_BLOCKS = (at.TextBlockParam, at.ImageBlockParam, at.DocumentBlockParam,
                 at.ThinkingBlockParam, at.RedactedThinkingBlockParam, at.ToolUseBlockParam,
                 at.ToolResultBlockParam)


@pytest.mark.parametrize(("path", "sdk_types"), [
    ("system[]", (at.TextBlockParam,)),
    ("messages[]", (at.MessageParam,)),
    # Every field of the block types we serve or refuse by a field (images, documents); the
    # other block types (server tools' results, search results) are refused by their type.
    ("messages[].content[]", SERVED_BLOCKS),
    ("messages[].content[].content[]", (at.TextBlockParam, at.ImageBlockParam)),
    ("tools[]", (at.ToolParam,)),
    ("tool_choice", (at.ToolChoiceParam,)),
    ("thinking", (at.ThinkingConfigParam,)),
    ("output_config", (at.OutputConfigParam,)),
    ("output_config.format", (at.JSONOutputFormatParam,)),
    ("metadata", (at.MetadataParam,)),
    ("cache_control", (at.CacheControlEphemeralParam,)),
    ("context_management", (bt.BetaContextManagementConfigParam,)),
    # The one edit served; the others are refused by their type.
    ("context_management.edits[]", (bt.BetaClearThinking20251015EditParam,)),
])
def test_nested_fields_are_the_sdks(path: str, sdk_types: tuple) -> None:
    assert set(MESSAGES_NESTED[path]) == _fields(*sdk_types), path


def test_docs_table_is_generated_from_the_tables() -> None:
    assert generated_section("messages-fields") == markdown_table()
