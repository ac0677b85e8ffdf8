"""Every request field of ``/v1/chat/completions`` and ``/v1/completions``, and what we do with it.

One table per endpoint, the single source of three things: the check that refuses what we do not
serve (``server.field_check``), docs/api.md's field table (:func:`markdown_table`), and the test
that holds both against OpenAI's spec (``tests/data/openai-openapi/openapi.json``:
``CreateChatCompletionRequest`` with its ``allOf`` parts, ``CreateCompletionRequest``).

A field is

- ``implemented``: it changes the output as OpenAI documents it. ``minimum``/``maximum``/``enum``
  are OpenAI's documented range (or ours where we are narrower, said in ``note``); a value
  outside it is a 400.
- ``refused``: a 400 naming the field, unless its value is null or one of ``noop`` (the value
  that asks for nothing: ``store: false``, ``modalities: ["text"]``), which changes nothing
  and so is honoured by doing nothing.
- ``ignored``: accepted and dropped, because it cannot change the output (``note`` says why).

Fields in neither the spec nor the table are ignored, as OpenAI-compatible servers do (clients
send their own extras). ``spec=False`` rows are our extensions (vLLM's or SGLang's names). The
sub-fields of the nested objects (``messages[]``, ``stream_options``, ``tools[].function``...)
have tables of the same rules in ``server.nested_fields``.

To change a field's status, edit its one line here; docs/api.md's table is regenerated from it
(``python -m splitserve.server.fields``) and a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["implemented", "refused", "ignored"]
Endpoint = Literal["chat", "completions"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_N = 16  # choices per prompt (``server.choices``); OpenAI documents up to 128


@dataclass(frozen=True, slots=True)
class FieldRule:
    """What one request field does. ``noop``: values of a refused field that are accepted
    because they ask for nothing (null always is). Bounds are inclusive."""

    status: Status
    note: str
    spec: bool = True
    noop: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    enum: tuple[Any, ...] | None = None


def implemented(note: str, *, minimum: float | None = None, maximum: float | None = None,
                enum: tuple[Any, ...] | None = None, spec: bool = True) -> FieldRule:
    """A field we honour, with its allowed range."""
    return FieldRule("implemented", note, spec, (), minimum, maximum, enum)


def refused(note: str, *, noop: tuple[Any, ...] = ()) -> FieldRule:
    """A field that is a 400 unless null or one of ``noop``; ``note`` says why."""
    return FieldRule("refused", note, noop=noop)


def ignored(note: str) -> FieldRule:
    """A field accepted and dropped because it changes no output; ``note`` says why."""
    return FieldRule("ignored", note)


def extension(note: str, *, minimum: float | None = None,
              maximum: float | None = None) -> FieldRule:
    """A field outside OpenAI's spec that we implement (vLLM's or SGLang's name)."""
    return implemented(note, minimum=minimum, maximum=maximum, spec=False)


_SEED: dict[str, Any] = {"minimum": INT64_MIN, "maximum": INT64_MAX}
_PENALTY: dict[str, Any] = {"minimum": -2, "maximum": 2}
_NO_OUTPUT_EFFECT = "an end-user id for OpenAI's abuse monitoring; changes no output"
_CACHE_HINT = "a prompt-cache hint; our prefix cache reuses every shared prefix on its own"

# Both endpoints. One line per field: flipping a status is a one-line change.
_SHARED: dict[str, FieldRule] = {
    "model": implemented("the served model's name or `default`"),
    "max_tokens": implemented("new tokens at most; 0 with `echo` scores the prompt", minimum=0),
    "temperature": implemented("0 is greedy", minimum=0, maximum=2),
    "top_p": implemented("nucleus sampling; must be above 0", minimum=0, maximum=1),
    "n": implemented("choices per prompt, each with its own seed stream; the prompt is "
                     f"computed once (ours: at most {MAX_N})", minimum=1, maximum=MAX_N),
    "seed": implemented("per-request random stream; a signed 64-bit integer", **_SEED),
    "stop": implemented("up to 4 stop strings of at most 1024 characters each"),
    "stream": implemented("server-sent events"),
    "stream_options": implemented("`include_usage`, `continuous_usage_stats` (vLLM): see "
                                  "the sub-fields; a 400 without `stream: true`, as in vLLM"),
    "presence_penalty": implemented("", **_PENALTY),
    "frequency_penalty": implemented("", **_PENALTY),
    "logit_bias": implemented("token id -> bias added to its logit; at most 300 entries"),
    "user": ignored(_NO_OUTPUT_EFFECT),
    # Extensions.
    "top_k": extension("-1 or 0: off", minimum=-1, maximum=INT32_MAX),
    "min_p": extension("", minimum=0, maximum=1),
    "repetition_penalty": extension("multiplies the logits of seen tokens (vLLM)"),
    "min_tokens": extension("no EOS or stop token before this many"),
    "stop_token_ids": extension("token ids that end the output; at most 256"),
    "ignore_eos": extension("keep generating past EOS"),
    "return_token_ids": extension("the generated ids in each choice"),
    "regex": extension("the output matches this regular expression"),
    "ebnf": extension("the output matches this GBNF grammar"),
    "choice": extension("the output is one of these strings (at most 1024, of at most 4096 "
                        "characters each)"),
    "priority": extension("lower first (vLLM): admitted first at the router's queue (then by "
                          "tenant) and on the workers, borrowing a less urgent running "
                          "request's slot when all are taken, and preempted last when a "
                          "worker's KV pages or rows run out; ties by arrival; default 0",
                          minimum=-(2**31), maximum=INT32_MAX),
    "cache_salt": extension("prefix-cache namespace: requests share cache only with the same "
                            "salt (vLLM)"),
    "thinking_token_budget": extension("a reasoning model thinks at most this many tokens, "
                                       "then its end marker is forced (vLLM); a 400 where the "
                                       "server has no reasoning parser", minimum=0),
}

CHAT_FIELDS: dict[str, FieldRule] = {
    **_SHARED,
    "messages": implemented("text content parts; `system`, `developer`, `user`, `assistant`, "
                            "`tool` roles; see the sub-fields"),
    "max_completion_tokens": implemented("new tokens at most", minimum=1),
    "max_tokens": implemented("deprecated alias of `max_completion_tokens`", minimum=1),
    "response_format": implemented("`text`, `json_object`, `json_schema` (grammar-enforced)"),
    "logprobs": implemented("the sampled tokens' logprobs"),
    "top_logprobs": implemented("most likely tokens per position", minimum=0, maximum=20),
    "tools": implemented("function tools, rendered into the prompt; at most 128"),
    "tool_choice": implemented("`none`, `auto`, `required` or a named function"),
    "parallel_tool_calls": implemented("false: at most one call"),
    "store": refused("we store no completions", noop=(False,)),
    "metadata": refused("tags for stored completions; we store none", noop=({},)),
    "service_tier": refused("one processing tier here", noop=("auto", "default")),
    "modalities": refused("text output only", noop=(["text"],)),
    "audio": refused("no audio output"),
    "prediction": refused("no predicted outputs"),
    "web_search_options": refused("no web search"),
    "verbosity": refused("a reasoning-model control the served model lacks"),
    "reasoning_effort": implemented(
        "a thinking budget (none 0, minimal 256, low 1024, medium 4096, high 16384, xhigh "
        "32768 tokens, max none); a 400 where the server has no reasoning parser",
        enum=("none", "minimal", "low", "medium", "high", "xhigh", "max")),
    "moderation": refused("no moderation model here"),
    "functions": refused("deprecated by OpenAI; use `tools`"),
    "function_call": refused("deprecated by OpenAI; use `tool_choice`"),
    "safety_identifier": ignored(_NO_OUTPUT_EFFECT),
    "prompt_cache_key": ignored(_CACHE_HINT),
    "prompt_cache_retention": ignored(_CACHE_HINT),
    "prompt_cache_options": ignored(_CACHE_HINT),
    # Extensions.
    "chat_template_kwargs": extension("more variables for the chat template, e.g. "
                                      "`enable_thinking` (vLLM); a name the template does not "
                                      "read is a 400"),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    **_SHARED,
    "prompt": implemented("a string, token ids, or a list of one of them"),
    "echo": implemented("the prompt prepended (with its logprobs if `logprobs`)"),
    "logprobs": implemented("the top-N logprobs per token", minimum=0, maximum=5),
    "suffix": refused("no insertion (fill-in-the-middle)", noop=("",)),
    "best_of": refused("vLLM removed it too; use `n`", noop=(1,)),
    # Extensions.
    "logprob_start_len": extension("score prompt tokens from this index on (SGLang)", minimum=0),
    "add_special_tokens": extension("false: the prompt already holds its special tokens"),
    "response_format": extension("`text`, `json_object`, `json_schema` (grammar-enforced)"),
}

FIELDS: dict[Endpoint, dict[str, FieldRule]] = {"chat": CHAT_FIELDS,
                                                "completions": COMPLETION_FIELDS}
PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _value_text(value: Any) -> str:
    import json

    return f"`{json.dumps(value)}`"


def markdown_table() -> str:
    """docs/api.md's field table: one row per field of either endpoint, spec fields first."""
    names = sorted(set(CHAT_FIELDS) | set(COMPLETION_FIELDS),
                   key=lambda n: (not (CHAT_FIELDS.get(n) or COMPLETION_FIELDS[n]).spec, n))
    rows = ["| field | chat | completions | notes |", "|---|---|---|---|"]
    for name in names:
        cells, notes = [], []
        for table in (CHAT_FIELDS, COMPLETION_FIELDS):
            rule = table.get(name)
            cells.append("—" if rule is None else rule.status)
            if rule is not None:
                notes.append(rule_note(rule))
        note = notes[0] if len(set(notes)) == 1 else "; ".join(
            f"{ep}: {n}" for ep, n in zip(("chat", "completions"), notes, strict=False) if n)
        ext = "" if (CHAT_FIELDS.get(name) or COMPLETION_FIELDS[name]).spec else " (ext.)"
        rows.append(f"| `{name}`{ext} | {cells[0]} | {cells[1]} | {note} |")
    return "\n".join(rows) + "\n"


def rule_note(rule: FieldRule) -> str:
    """A rule's note in that table: its note, its range, and the values a refused field accepts."""
    parts = [rule.note] if rule.note else []
    if rule.minimum is not None or rule.maximum is not None:
        lo = "" if rule.minimum is None else _bound(rule.minimum)
        hi = "" if rule.maximum is None else _bound(rule.maximum)
        parts.append(f"range {lo}..{hi}")
    if rule.noop:
        parts.append("accepted as " + ", ".join(["`null`"] + [_value_text(v) for v in rule.noop]))
    return "; ".join(parts)


def _bound(x: float) -> str:
    return {INT64_MIN: "-2^63", INT64_MAX: "2^63-1", INT32_MAX: "2^31-1",
            -(2**31): "-2^31"}.get(x, f"{x:g}")


if __name__ == "__main__":
    print(markdown_table(), end="")
