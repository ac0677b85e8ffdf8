"""Grammar-constrained decoding through a launched disaggregated cluster on the default model:
real JSONSchemaBench schemas, json_object, regex, a SQL EBNF grammar and choice lists; bad
constraints get a 400 naming the problem; constrained neighbours do not change a greedy request.

Requests are sent concurrently (one batch on the workers) to keep the module near a minute on
two cores.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from splitserve.engine.grammar.xgrammar_backend import XGrammarBackend
from tests.conftest import DATA
from tests.e2e.conftest import complete_ids, worker_pages_used

SCHEMA_DIR = DATA / "jsonschemabench" / "schemas"
SQL_GRAMMAR = (Path(__file__).parent / "data" / "sql_select.gbnf").read_text()

# 32 real schemas that xgrammar compiles in well under a second and whose text fits a prompt.
SCHEMAS = [
    *(f"Github_trivial/{n}.json" for n in (
        "o25982", "o27032", "o3616", "o36250", "o44126", "o60854", "o69753", "o70564",
        "o71845", "o73407", "o77414", "o78398", "o8484", "o89152", "o89499", "o90950",
    )),
    *(f"Github_easy/{n}.json" for n in ("o39432", "o41692", "o81574", "o89671")),
    *(f"Glaiveai2K/{n}.json" for n in (
        "calculate_area_248bb00a", "generate_invoice_68967986", "generate_invoice_699a7e70",
    )),
    *(f"Snowplow/sp_{n}_Normalized.json" for n in (320, 59, 67, 89)),
    *(f"WashingtonPost/wp_{n}_Normalized.json" for n in (39, 52, 88, 95, 97)),
]
IPV4 = r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


def _chat(cluster, content: str, max_tokens: int, timeout: float = 300, **kw: Any
          ) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **kw}
    return httpx.post(cluster.config.url + "/v1/chat/completions", json=body, timeout=timeout)


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _concurrently(calls: list) -> list:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_jsonschemabench_schemas_validate(grammar_cluster) -> None:
    schemas = [json.loads((SCHEMA_DIR / name).read_text()) for name in SCHEMAS]
    calls = [
        lambda s=s: _chat(
            grammar_cluster,
            "Reply with a short JSON instance of this JSON schema, nothing else:\n"
            + json.dumps(s, separators=(",", ":")),
            max_tokens=96,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": s, "strict": True}},
        )
        for s in schemas
    ]
    completed = truncated = 0
    for name, schema, response in zip(SCHEMAS, schemas, _concurrently(calls)):
        choice = _ok(response)
        if choice["finish_reason"] == "length":
            truncated += 1  # counted, not validated: the grammar had not ended yet
            continue
        assert choice["finish_reason"] == "stop", name
        text = choice["message"]["content"]
        instance = json.loads(text)
        validator = jsonschema.validators.validator_for(schema)(schema)
        errors = [e.message for e in validator.iter_errors(instance)]
        assert not errors, f"{name}: {text!r} breaks its schema: {errors[:3]}"
        completed += 1
    print(f"\n{completed} of {len(SCHEMAS)} schema outputs completed and valid, {truncated} truncated")
    # The 135M model loops on some schemas (greedy); most finish well within 96 tokens.
    assert completed >= len(SCHEMAS) // 2, f"only {completed} outputs completed"


def test_kinds_regex_ebnf_choice_json_object(grammar_cluster, tokenizer) -> None:
    choices = ["red", "green", "blue"]
    c = grammar_cluster
    ipv4, date, sql, choice, obj, completion = _concurrently([
        lambda: _chat(c, "What is the IP address of the local DNS server?", 24, regex=IPV4),
        lambda: _chat(c, "When did the first moon landing happen?", 16, regex=DATE),
        lambda: _chat(c, "Write a SQL query listing the names of users older than 30.", 64,
                      ebnf=SQL_GRAMMAR),
        lambda: _chat(c, "What colour is the sky?", 8, choice=choices),
        lambda: _chat(c, "Return a JSON object describing a cat: name, age, colour.", 64,
                      response_format={"type": "json_object"}),
        lambda: httpx.post(c.config.url + "/v1/completions", timeout=300, json={
            "model": "default", "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "choice": ["Paris", "London"]}),
    ])
    for response, pattern in ((ipv4, IPV4), (date, DATE)):
        reply = _ok(response)
        assert reply["finish_reason"] == "stop", reply
        assert re.fullmatch(pattern, reply["message"]["content"]), reply
    reply = _ok(sql)
    if reply["finish_reason"] == "stop":
        matcher = XGrammarBackend(tokenizer).compile("ebnf", SQL_GRAMMAR).create_matcher()
        ids = tokenizer.encode(reply["message"]["content"], add_special_tokens=False)
        assert all(matcher.accept_token(t) for t in ids) and matcher.can_end(), reply
    else:
        assert reply["message"]["content"].startswith("SELECT "), reply
    reply = _ok(choice)
    assert reply["finish_reason"] == "stop" and reply["message"]["content"] in choices
    reply = _ok(obj)
    assert reply["finish_reason"] == "stop", reply["message"]["content"]
    assert isinstance(json.loads(reply["message"]["content"]), dict)
    assert _ok(completion)["text"] in ("Paris", "London")


@pytest.mark.parametrize(("body", "expected"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "strin"),
    ({"regex": "[a-"}, "regex"),
    ({"ebnf": 'root ::= "a" ('}, "EBNF"),
    ({"regex": "a+", "choice": ["a"]}, "regex and choice"),
    ({"choice": []}, "choice"),
])
def test_bad_constraint_is_400_and_server_keeps_serving(grammar_cluster, body, expected) -> None:
    for stream in (False, True):
        r = httpx.post(grammar_cluster.config.url + "/v1/completions", timeout=120, json={
            "model": "default", "prompt": "Hi", "max_tokens": 4, "stream": stream, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert expected in error["message"] and error["type"] == "invalid_request_error"
    assert _ok(_chat(grammar_cluster, "Yes or no?", 4, choice=["yes", "no"]))["finish_reason"]


def test_constrained_neighbours_do_not_change_greedy_tokens(grammar_cluster, tokenizer) -> None:
    prompt = tokenizer.encode("The three primary colours are", add_special_tokens=False)
    alone = complete_ids(grammar_cluster, prompt, 24)["choices"][0]["token_ids"]
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}}
    neighbours = [
        lambda: _chat(grammar_cluster, "Pick a colour as JSON.", 32, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}),
        lambda: _chat(grammar_cluster, "An IP address?", 24, regex=IPV4),
        lambda: _chat(grammar_cluster, "Colour?", 8, choice=["red", "green"]),
    ] * 2
    beside = [lambda: complete_ids(grammar_cluster, prompt, 24)]
    results = _concurrently(neighbours + beside)
    assert results[-1]["choices"][0]["token_ids"] == alone
    for r in results[:-1]:
        _ok(r)


def test_colocated_worker_constrains_too(colocated_cluster) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    ip, colour, city = _concurrently([
        lambda: _chat(colocated_cluster, "An IP address?", 24, regex=IPV4),
        lambda: _chat(colocated_cluster, "Colour?", 8, choice=["red", "green"]),
        lambda: _chat(colocated_cluster, "Where is the Eiffel tower? Answer in JSON.", 48,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "c", "schema": schema}}),
    ])
    assert re.fullmatch(IPV4, _ok(ip)["message"]["content"])
    assert _ok(colour)["message"]["content"] in ("red", "green")
    reply = _ok(city)
    if reply["finish_reason"] == "stop":
        jsonschema.validate(json.loads(reply["message"]["content"]), schema)


# --- Reduced public reports (issue 17): each must now hold end to end. ---------------------


def _samples(cluster, schema: dict, strict: bool, n: int = 8, **kw: Any) -> list[httpx.Response]:
    """``n`` sampled (temperature 1, distinct seeds) answers under ``schema``, concurrently."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
    return _concurrently([
        lambda seed=seed: _chat(cluster, "Answer in JSON.", 24, temperature=1.0, seed=seed,
                                response_format=fmt, **kw)
        for seed in range(n)
    ])


def _all_finished_valid(responses: list[httpx.Response], schema: dict) -> int:
    finished = 0
    for response in responses:
        choice = _ok(response)
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            finished += 1
    return finished


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^a+$", "maxLength": 2},
    # additionalProperties false: otherwise sampling adds keys and rarely ends within budget.
    {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-z]+$",
                                             "maxLength": 3}}, "required": ["k"],
     "additionalProperties": False},
    {"type": "string", "pattern": "^a+$", "minLength": 3},
], ids=["maxLength", "nested_maxLength", "minLength"])
def test_xgrammar_report_length_bounds_next_to_pattern_hold_under_strict(
    grammar_cluster, schema
) -> None:
    # Reported: HTTP 200 with "aaaaaa" (xgrammar logs that it ignores the length bounds).
    # Every finished sample validates (jsonschema raises otherwise); some must finish.
    assert _all_finished_valid(_samples(grammar_cluster, schema, strict=True), schema) >= 1


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^a+$"},
    {"type": "integer", "maximum": 9},
    {"type": "integer", "minimum": 3},
], ids=["pattern", "maximum", "minimum"])
def test_outlines_fallback_report_dropped_bounds_hold(grammar_cluster, schema) -> None:
    # Reported: the outlines fallback accepted "", n = 12, -1 and 01 for these. Sampled
    # integers may run past the budget; every finished one validates, and some finish.
    assert _all_finished_valid(_samples(grammar_cluster, schema, strict=False), schema) >= 1


def test_llama_cpp_report_gbnf_empty_alternative_compiles(grammar_cluster) -> None:
    # Reported: `space ::= | " "` (llama.cpp's grammar README) was a 400 "Expect element".
    grammar = 'root ::= "yes" space "no"\nspace ::= | " "\n'
    reply = _ok(_chat(grammar_cluster, "Say yes no.", 8, ebnf=grammar))
    assert reply["finish_reason"] == "stop" and reply["message"]["content"] in ("yesno", "yes no")


def test_dependencies_report_is_enforced_under_strict(grammar_cluster) -> None:
    # Reported: a real-world schema's `dependencies` not enforced, silently (non-strict). The
    # chain now rewrites it into anyOf (schema_rewrite), which llguidance enforces: strict runs.
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a"], "dependencies": {"a": ["b"]}, "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = _chat(grammar_cluster, "Give a as JSON.", 24, response_format=fmt)
    assert "x-splitserve-constraint" not in r.headers
    instance = json.loads(_ok(r)["message"]["content"])
    jsonschema.validate(instance, schema)
    assert "b" in instance


def test_unenforceable_keyword_strict_is_400_and_non_strict_says_partial(grammar_cluster) -> None:
    # uniqueItems: no backend enforces it. Strict refuses, naming it; non-strict says so.
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
              "maxItems": 3}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = _chat(grammar_cluster, "JSON please.", 16, response_format=fmt)
    assert r.status_code == 400, r.text
    assert "uniqueItems at /" in r.json()["error"]["message"]
    fmt["json_schema"]["strict"] = False
    # Two tokens: the header is the point; a finished output could repeat an item, which the
    # safety net would count (that is its job) and the module's counter test would see.
    r = _chat(grammar_cluster, "JSON please.", 2, response_format=fmt)
    assert r.status_code == 200, r.text
    assert r.headers["x-splitserve-constraint"].startswith("partial; ignored=uniqueItems@/")
    loose = _chat(grammar_cluster, "JSON please.", 16, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}})
    assert "x-splitserve-constraint" not in loose.headers


def test_compact_json_by_default_whitespace_on_request(grammar_cluster) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    compact, flexible = _concurrently([
        lambda: _chat(grammar_cluster, "Give a and b as JSON.", 48, response_format=fmt),
        lambda: _chat(grammar_cluster, "Give a and b as JSON.", 48, response_format=fmt,
                      whitespace_flexible=True),
    ])
    text = _ok(compact)["message"]["content"]
    parsed = json.loads(text)
    assert text == json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)
    _ok(flexible)


ALL_SCHEMAS = sorted(p.relative_to(SCHEMA_DIR).as_posix() for p in SCHEMA_DIR.glob("*/*.json"))
PROMPT_SCHEMA_CHARS = 1200  # the prompt shows at most this much of the schema; the grammar holds


def _every_schema(cluster, flexible: bool) -> int:
    """Every schema copied in tests/data (70), non-strict, greedy, 256 tokens, concurrently.
    Asserts every finished output validates (partial plans included: the goal is no violation
    in either mode). Returns: how many finished."""
    schemas = [json.loads((SCHEMA_DIR / name).read_text()) for name in ALL_SCHEMAS]
    assert len(schemas) >= 50
    calls = [
        lambda s=s: _chat(
            cluster,
            "Reply with a short JSON instance of this JSON schema, nothing else:\n"
            + json.dumps(s, separators=(",", ":"))[:PROMPT_SCHEMA_CHARS],
            max_tokens=256, whitespace_flexible=flexible, timeout=900,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": s}},
        )
        for s in schemas
    ]
    done = refused = 0
    for name, schema, response in zip(ALL_SCHEMAS, schemas, _concurrently(calls)):
        if response.status_code == 400 and "cannot compile" in response.text:
            refused += 1  # no backend compiled it (in time): a refusal, not a violation
            continue
        choice = _ok(response)
        if choice["finish_reason"] != "stop":
            continue
        instance = json.loads(choice["message"]["content"])
        validator = jsonschema.validators.validator_for(schema)(schema)
        errors = [e.message for e in validator.iter_errors(instance)]
        assert not errors, f"{name} (flexible={flexible}) breaks its schema: {errors[:3]}"
        done += 1
    print(f"\n{refused} of {len(schemas)} schemas compiled by no backend in time (flexible="
          f"{flexible})")
    return done


def test_every_finished_output_of_70_real_schemas_validates(grammar_cluster) -> None:
    done = _every_schema(grammar_cluster, flexible=False)
    print(f"\nfinished within 256 tokens, compact JSON: {done}/{len(ALL_SCHEMAS)}")
    assert done >= 10  # 21 of 70 on 2026-12-02: the check must have outputs to check


@pytest.mark.skipif(
    os.environ.get("SPLITSERVE_GRAMMAR_SHARE") != "1",
    reason="a figure, not a check (70 more requests of up to 256 tokens, minutes on 2 cores): "
    "SPLITSERVE_GRAMMAR_SHARE=1 runs it",
)
def test_share_finishing_within_256_tokens_free_whitespace(grammar_cluster) -> None:
    done = _every_schema(grammar_cluster, flexible=True)
    print(f"\nfinished within 256 tokens, free whitespace: {done}/{len(ALL_SCHEMAS)}")


def test_violation_counter_is_zero_after_the_module(grammar_cluster) -> None:
    # Runs after the tests above (module order): the json_schema safety net saw no violation.
    text = httpx.get(grammar_cluster.config.url + "/metrics", timeout=10).text
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("splitserve_constraint_violations_total{")]
    assert "splitserve_constraint_violations" in text  # the counter is exported
    assert sum(counts) == 0, [line for line in text.splitlines() if "violations" in line]


def test_no_pages_leak_after_grammar_requests(grammar_cluster) -> None:
    # Runs last in the module: every constrained request above, failed ones included, is done.
    deadline = time.monotonic() + 10
    while any(worker_pages_used(grammar_cluster).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(worker_pages_used(grammar_cluster).values())
