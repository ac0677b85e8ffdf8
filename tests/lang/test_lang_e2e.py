"""The DSL against a launched cluster serving the default model. The model is small: the tests
check structure (variables, members, branches, messages, order), not answers."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve import lang
from splitserve.lang.endpoint import Capabilities

pytestmark = pytest.mark.slow

FEW_SHOT = (
    "Answer with one word.\nQ: What color is the sky?\nA: blue\n"
    "Q: What do cows drink?\nA: water\n"
)


@lang.function
def qa(s, question: str):
    s += FEW_SHOT + "Q: " + question + "\nA:" + lang.gen("answer", max_tokens=6, stop="\n")


@lang.function
def judged(s, question: str):
    qa(s, question)
    s += "\nIs the answer correct? " + lang.select("verdict", ["yes", "no", "unsure"])


def test_captured_variables_and_select_member(endpoint) -> None:
    s = judged.run("What is 2+2?", backend=endpoint, temperature=0)
    assert isinstance(s["answer"], str) and s["answer"] in s.text()
    assert s["verdict"] in ("yes", "no", "unsure") and s.text().endswith(s["verdict"])
    meta = s.meta("verdict")
    assert len(meta["scores"]) == 3 and all(n >= 1 for n in meta["num_tokens"])
    assert meta["scores"].index(max(meta["scores"])) == ["yes", "no", "unsure"].index(
        s["verdict"])


def test_select_scores_match_transformers(endpoint, hf_model, tokenizer) -> None:
    choices = ["Paris", " Paris", "London is big", "Rome"]
    prompt = "The capital of France is"
    s = lang.function(lambda s: s.__iadd__(prompt + lang.select("c", choices))).run(
        backend=endpoint)
    base = tokenizer.encode(prompt)
    for choice, got in zip(choices, s.meta("c")["scores"]):
        ids = tokenizer.encode(prompt + choice)
        k = next((i for i, (a, b) in enumerate(zip(base, ids)) if a != b), len(base))
        with torch.inference_mode():
            lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        want = sum(lp[i - 1, ids[i]].item() for i in range(k, len(ids))) / (len(ids) - k)
        assert abs(got - want) < 1e-3, (choice, got, want)


def test_fork_returns_branches_sharing_the_prefix(endpoint) -> None:
    @lang.function
    def tips(s):
        s += FEW_SHOT + "Q: Name a fruit.\nA:"
        forks = s.fork(3)
        for f in forks:
            f += lang.gen("fruit", max_tokens=4, stop="\n", temperature=1.0)
        forks.join()
        return forks

    s = tips.run(backend=endpoint)
    prefix = s.text()
    forks = s.return_value
    assert len(forks) == 3
    for f in forks:
        assert f.text().startswith(prefix) and f.text() == prefix + f["fruit"]


def test_fork_branches_hit_the_prefix_cache(endpoint, needs_prefix_cache) -> None:
    @lang.function
    def tips(s):
        s += FEW_SHOT * 3 + "Q: Name a fruit.\nA:"
        forks = s.fork(4)
        forks += lang.gen("fruit", max_tokens=3, stop="\n")
        forks.join()

    s = tips.run(backend=endpoint, temperature=0)
    branches = [st for st in s.ctx.states if st is not s]
    assert all(b.meta("fruit")["cached_tokens"] > 0 for b in branches)


def test_roles_render_through_the_chat_template(endpoint, tokenizer) -> None:
    @lang.function
    def chat(s):
        s += lang.system("You are terse.")
        s += lang.user("Say hi.")
        s += lang.assistant(lang.gen("r1", max_tokens=6))
        with s.user():
            s += "Again."
        with s.assistant():
            s += lang.gen("r2", max_tokens=6)

    s = chat.run(backend=endpoint, temperature=0)
    msgs = s.messages()
    assert len(msgs) == 5 and [m["role"] for m in msgs][-1] == "assistant"
    assert s.text() == tokenizer.apply_chat_template(msgs, tokenize=False)


def test_streaming_yields_the_non_streamed_text(endpoint) -> None:
    plain = qa.run("What is ice?", backend=endpoint, temperature=0)
    streamed = qa.run("What is ice?", backend=endpoint, temperature=0, stream=True)
    chunks = list(streamed.text_iter())
    assert "".join(chunks) == plain.text() and streamed["answer"] == plain["answer"]


def test_run_batch_of_16_keeps_order(endpoint) -> None:
    questions = [f"What is {i} plus one?" for i in range(16)]
    out = qa.run_batch([{"question": q} for q in questions], backend=endpoint, temperature=0,
                       num_threads=16)
    assert len(out) == 16
    for q, s in zip(questions, out):
        assert isinstance(s, lang.ProgramState), s
        assert f"Q: {q}\nA:" in s.text() and "answer" in s


def test_server_down_names_the_step(endpoint) -> None:
    with pytest.raises(lang.ProgramError, match=r"'qa'.*step 1 \(gen 'answer'\).*unreachable"):
        qa.run("x", backend=lang.Endpoint("http://127.0.0.1:9"))


def test_dtype_int_parses_as_int(endpoint, needs_constraints) -> None:
    s = lang.function(lambda s: s.__iadd__("Seven times six is " + lang.gen("n", dtype=int)))
    assert isinstance(s.run(backend=endpoint, temperature=0)["n"], int)


def test_json_schema_output_validates(endpoint, needs_constraints) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
              "age": {"type": "integer"}}, "required": ["name", "age"]}
    prog = lang.function(lambda s: s.__iadd__(
        "A person as JSON: " + lang.gen("p", json_schema=schema, max_tokens=48)))
    jsonschema.validate(json.loads(prog.run(backend=endpoint, temperature=0)["p"]), schema)


def test_unsupported_feature_is_a_clear_error(endpoint) -> None:
    """A server whose constraint probe came back negative (a third-party one: ours enforces
    them, ``needs_constraints``) gets a clear error instead of unconstrained output. The probe's
    answer is given, so the test runs against our server rather than skipping on it."""
    assert endpoint.capabilities().constraints
    other = lang.Endpoint(endpoint.url)
    other._caps = Capabilities(constraints=False, prompt_logprobs=True, prefix_cache=True,
                               tools=True, grammar=True)
    prog = lang.function(lambda s: s.__iadd__("n=" + lang.gen("n", dtype=int)))
    with pytest.raises(lang.ProgramError, match="does not enforce constraints"):
        prog.run(backend=other)
