"""The DSL without a model: the tracer's IR, the interpreter on a fake backend, error reports."""

from __future__ import annotations

import pytest

from splitserve import lang
from splitserve.lang.chat_template import ChatTemplate
from splitserve.lang.prefix import warm_shared_prefix
from tests.lang.fake_backend import FakeBackend


@lang.function
def few_shot(s, question):
    s += "Q: 1+1?\nA: 2\nQ: " + question + "\nA:" + lang.gen("answer", stop="\n")
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" Hint {i}:" + lang.gen("hint", max_tokens=4)
    forks.join()
    s += " Final:" + lang.select("final", ["yes", "no"])


def test_trace_records_the_ir_without_a_model() -> None:
    tr = few_shot.trace(question="2+2?")
    kinds = [type(n).__name__ for n in tr.nodes]
    assert kinds == ["ConstantText", "Gen", "Fork", "Join", "ConstantText", "Select"]
    assert tr.complete and tr.nodes[0].text == "Q: 1+1?\nA: 2\nQ: 2+2?\nA:"
    fork = tr.nodes[2]
    assert fork.n == 2 and [type(n).__name__ for n in fork.branches[1]] == ["ConstantText", "Gen"]
    assert fork.branches[1][0].text == " Hint 1:" and tr.nodes[3].fork_index == 2
    assert tr.nodes[1].stop == ["\n"] and tr.nodes[5].choices == ["yes", "no"]
    assert tr.constant_prefix() == tr.nodes[:1]


def test_trace_stops_where_the_program_uses_a_model_output() -> None:
    @lang.function
    def branching(s):
        with s.user():
            s += "Pick"
        s += lang.assistant(lang.select("x", ["a", "b"]))
        if s["x"] == "a":
            s += lang.user("more")

    tr = branching.trace()
    assert not tr.complete and "'x'" in tr.stopped_at
    kinds = [type(n).__name__ for n in tr.nodes]
    assert kinds == ["RoleBegin", "ConstantText", "RoleEnd", "RoleBegin", "Select", "RoleEnd"]


def test_gen_rejects_two_constraints() -> None:
    with pytest.raises(ValueError, match="one constraint"):
        lang.gen("x", regex="a", dtype=int)
    with pytest.raises(TypeError, match="cannot append int"):
        lang.function(lambda s: s.__iadd__(3)).trace()


def test_run_captures_variables_and_forks() -> None:
    backend = FakeBackend()
    s = few_shot.run(question="2+2?", backend=backend)
    assert s["answer"] == "<23>" and s["final"] == "yes"
    assert s.text() == "Q: 1+1?\nA: 2\nQ: 2+2?\nA:<23> Final:yes"
    # The fork's shared prefix was sent once before the branches.
    assert backend.prefills == ["Q: 1+1?\nA: 2\nQ: 2+2?\nA:<23>"]


def test_step_error_names_program_step_and_branch() -> None:
    backend = FakeBackend(fail_on="Hint 1")
    with pytest.raises(lang.ProgramError) as info:
        few_shot.run(question="2+2?", backend=backend)
    err = info.value
    assert err.program == "few_shot" and err.step == "gen 'hint'" and err.step_index == 1
    assert "fork@2[1]" in str(err) and "fake failure" in str(err)


def test_run_batch_keeps_order_and_isolates_failures() -> None:
    backend = FakeBackend(fail_on="bad")
    qs = [f"q{i}" for i in range(7)] + ["bad"] + [f"q{i}" for i in range(7, 15)]
    out = few_shot.run_batch([{"question": q} for q in qs], backend=backend, num_threads=4)
    assert len(out) == 16
    assert isinstance(out[7], lang.ProgramError) and out[7].batch_index == 7
    assert "batch item 7" in str(out[7]) and out[7].step == "gen 'answer'"
    for i, q in enumerate(qs):
        if i != 7:
            assert f"Q: {q}\n" in out[i].text()
    # One fork prefix per item that got that far (the shared text is too short to warm).
    assert len(backend.prefills) == 15


def test_program_exception_is_reported_with_program_name() -> None:
    @lang.function
    def broken(s):
        s += "x" + lang.gen("y")
        raise RuntimeError("tool crashed")

    with pytest.raises(lang.ProgramError, match="'broken' failed: the program raised Runtime"):
        broken.run(backend=FakeBackend())


def test_roles_render_through_the_template_and_stream_the_same_text() -> None:
    @lang.function
    def chat(s):
        s += lang.system("Be brief.")
        with s.user():
            s += "Hi " + lang.gen("name", max_tokens=3)
        s += lang.assistant(lang.gen("reply"))

    backend = FakeBackend(template=True)
    s = chat.run(backend=backend)
    assert [m["role"] for m in s.messages()] == ["system", "user", "assistant"]
    assert s.text().startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ")
    streamed = chat.run(backend=backend, stream=True)
    assert "".join(streamed.text_iter()) == s.text()
    assert "".join(chat.run(backend=backend, stream=True).text_iter("reply")) == s["reply"]


def test_text_outside_a_role_is_a_clear_error() -> None:
    @lang.function
    def mixed(s):
        s += lang.user("hi")
        s += "loose text"

    with pytest.raises(lang.ProgramError, match="step 3 .*text outside a role"):
        mixed.run(backend=FakeBackend(template=True))


def test_dtype_int_parses() -> None:
    @lang.function
    def count(s):
        s += "n=" + lang.gen("n", dtype=int)

    assert count.run(backend=FakeBackend())["n"] == 42


def test_chat_template_matches_transformers(tokenizer) -> None:
    tmpl = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token or "",
                        tokenizer.eos_token or "")
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    assert tmpl.render(msgs) == tokenizer.apply_chat_template(msgs, tokenize=False)
    want = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert tmpl.render_open(msgs[:1], "assistant", "") == want
    assert tmpl.render_open(msgs[:1], "assistant", "So") == want + "So"


def test_shared_prefix_needs_enough_common_text() -> None:
    backend = FakeBackend()
    short = [few_shot.trace(question=q) for q in ("a", "b")]
    assert warm_shared_prefix(backend, short) is None  # "Q: 1+1?\nA: 2\nQ: " is < 32 chars
    long = [lang.function(lambda s, q: s.__iadd__("x" * 40 + q + lang.gen("a"))).trace(q=q)
            for q in ("a", "b")]
    assert warm_shared_prefix(backend, long).text == "x" * 40
