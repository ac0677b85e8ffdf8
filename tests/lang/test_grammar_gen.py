"""``gen(grammar=...)`` without a model: what each backend sends, under run, run_batch and fork,
and the clear error from servers that refuse or ignore the grammar field (real HTTP servers
speaking a scripted slice of the API, tests/lang/fake_openai_server.py)."""

from __future__ import annotations

import pytest

from splitserve import lang
from splitserve.lang.grammar_field import PROBE_GRAMMAR, PROBE_OUTPUT
from tests.lang.fake_backend import CHATML
from tests.lang.fake_openai_server import chat_answer, completion_answer, fake_openai_server

YES_NO = 'root ::= "yes" | "no"\n'


def grammar_server(field: str = "ebnf", mode: str = "enforce"):
    """A responder: ``enforce`` answers the probe grammar with its one word and other grammar
    requests with ``yes``; ``ignore`` answers prose whatever the body; ``refuse`` is a 400
    naming the field, as a strict OpenAI-compatible server does."""
    def respond(path: str, body: dict):
        chat = path == "/v1/chat/completions"
        if field in body and mode == "refuse":
            return 400, {"error": {"message": f"Unrecognized request argument supplied: {field}",
                                   "type": "invalid_request_error", "param": field}}
        text = "Sure, here is some text."
        if field in body and mode == "enforce":
            text = PROBE_OUTPUT if body[field] == PROBE_GRAMMAR else "yes"
        return chat_answer(text) if chat else completion_answer(text)
    return respond


@lang.function
def ask(s, question: str):
    s += "Q: " + question + "\nA: " + lang.gen("answer", grammar=YES_NO, max_tokens=4)


@lang.function
def ask_chat(s, question: str):
    s += lang.user(question)
    s += lang.assistant(lang.gen("answer", grammar=YES_NO, max_tokens=4))


@lang.function
def ask_three(s):
    s += "Q: Is water wet?\nA:"
    forks = s.fork(3)
    forks += " " + lang.gen("answer", grammar=YES_NO, max_tokens=4)
    forks.join()
    return [f["answer"] for f in forks]


def test_grammar_is_the_gens_one_constraint() -> None:
    assert lang.gen("x", grammar=YES_NO).grammar == YES_NO
    with pytest.raises(ValueError, match="one constraint, got regex and grammar"):
        lang.gen("x", regex="a", grammar=YES_NO)
    with pytest.raises(ValueError, match="one constraint, got grammar and dtype"):
        lang.gen("x", grammar=YES_NO, dtype=int)
    with pytest.raises(ValueError, match="GBNF text"):
        lang.gen("x", grammar="  ")
    trace = ask.trace(question="q")
    assert [n.grammar for n in trace.nodes if isinstance(n, lang.Gen)] == [YES_NO]


@pytest.mark.parametrize("backend_kind", ["openai_compatible", "endpoint"])
def test_grammar_goes_in_the_ebnf_field_under_run_batch_and_fork(backend_kind: str) -> None:
    with fake_openai_server(grammar_server(), template=CHATML) as server:
        backend = (lang.OpenAICompatible(server.url + "/v1", "m")
                   if backend_kind == "openai_compatible" else lang.Endpoint(server.url))
        assert ask.run("Is fire hot?", backend=backend)["answer"] == "yes"
        batch = ask.run_batch([{"question": q} for q in ("a?", "b?", "c?")], backend=backend)
        assert [s["answer"] for s in batch] == ["yes"] * 3
        assert ask_three.run(backend=backend).return_value == ["yes"] * 3
        assert ask_chat.run("Is ice cold?", backend=backend)["answer"] == "yes"
        sent = [b for path in ("/v1/completions", "/v1/chat/completions")
                for b in server.bodies(path) if b.get("ebnf") == YES_NO]
    assert len(sent) == 8 and all(b["max_tokens"] == 4 for b in sent)
    # The role program: chat messages, or the text of the server's template (Endpoint).
    assert any("messages" in b or "<|im_start|>assistant" in b.get("prompt", "") for b in sent)


def test_another_field_name_for_other_servers() -> None:
    with fake_openai_server(grammar_server("grammar")) as server:
        backend = lang.OpenAICompatible(server.url + "/v1", "m", grammar_field="grammar")
        assert ask.run("Is fire hot?", backend=backend)["answer"] == "yes"
        assert server.bodies("/v1/completions")[-1]["grammar"] == YES_NO


@pytest.mark.parametrize("mode, why", [("ignore", "ignored the 'ebnf' field"),
                                       ("refuse", "refused the 'ebnf' field.*Unrecognized")])
@pytest.mark.parametrize("backend_kind", ["openai_compatible", "endpoint"])
def test_a_server_without_grammars_is_a_clear_error(backend_kind: str, mode: str,
                                                    why: str) -> None:
    with fake_openai_server(grammar_server(mode=mode)) as server:
        backend = (lang.OpenAICompatible(server.url + "/v1", "m")
                   if backend_kind == "openai_compatible" else lang.Endpoint(server.url))
        with pytest.raises(lang.ProgramError, match=r"step \d \(gen 'answer'\).*does not "
                                                    rf"enforce EBNF grammars.*{why}") as info:
            ask.run("Is fire hot?", backend=backend)
        assert info.value.__cause__.unsupported
        # Nothing was generated unconstrained: the one grammar request sent was the probe.
        assert [b["ebnf"] for b in server.bodies("/v1/completions") if "ebnf" in b] == [
            PROBE_GRAMMAR]


def test_grammar_field_none_refuses_without_asking() -> None:
    with fake_openai_server(grammar_server()) as server:
        backend = lang.OpenAICompatible(server.url + "/v1", "m", grammar_field=None)
        with pytest.raises(lang.ProgramError, match="grammar_field=None"):
            ask.run("q", backend=backend)
        assert server.requests == []
