"""The mask filled on the mask thread during the forward pass gives the same tokens as the mask
filled before it, on the real default model in-process: greedy constrained requests (both
backends, jump-forward on) next to unconstrained ones, which keep their tokens from running alone.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest

from splitserve.engine.grammar.batch_mask import BatchMask
from splitserve.engine.grammar.request_grammar import RequestGrammar
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from tests.engine_core import make_core

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PERSON = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}},
    "required": ["name", "age", "city"],
})
IPV4 = r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"
CHOICES = ["lighthouse", "harbour", "open sea"]
# (backend, kind, constraint text, prompt); None: an unconstrained request.
REQUESTS: list[tuple[str | None, str, str, str]] = [
    ("xgrammar", "json_schema", PERSON, "Give a person record as JSON."),
    (None, "", "", "Tell me about lighthouses."),
    ("xgrammar", "regex", IPV4, "What is the IP address of the local host?"),
    ("outlines", "regex", IPV4, "Write an IPv4 address."),
    (None, "", "", "Write a haiku about the sea."),
    ("xgrammar", "choice", json.dumps(CHOICES), "Where does the keeper live?"),
    ("xgrammar", "json_object", "", "Describe a ship as a JSON object."),
]
MAX_NEW_TOKENS = 24


def _generate(model, tokenizer: Any, backends: dict, overlap: bool,
              only_unconstrained: bool = False) -> list[list[int]]:
    """Greedy outputs of ``REQUESTS`` (all in one batch), in order."""
    net, cfg = model
    core = make_core(net, KVPool(cfg.kv_layout(16, "float32"), 128), cfg.eos_token_ids,
                     runner={"vocab_size": cfg.vocab_size, "overlap_grammar_mask": overlap},
                     jump_forward=True)
    scheduler = core.scheduler
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    reqs = []
    for i, (backend, kind, text, prompt) in enumerate(REQUESTS):
        if only_unconstrained and backend is not None:
            continue
        ids = encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        ))
        req = Req(f"r{i}", list(ids), SamplingParams(max_new_tokens=MAX_NEW_TOKENS,
                                                     temperature=0.0))
        if backend is not None:
            matcher = backends[backend].compile(kind, text).create_matcher(max_rollback_tokens=64)
            req.grammar = RequestGrammar(matcher, cfg.vocab_size, cfg.eos_token_ids, encode)
        reqs.append(req)
        scheduler.add(req)
    try:
        while scheduler.has_work:
            core.step()
    finally:
        core.close()
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def serial(model, tokenizer, backends) -> list[list[int]]:
    return _generate(model, tokenizer, backends, overlap=False)


def test_overlap_gives_the_serial_tokens(model, tokenizer, backends, serial) -> None:
    assert _generate(model, tokenizer, backends, overlap=True) == serial


def test_overlap_waits_for_a_slow_fill(model, tokenizer, backends, serial, monkeypatch) -> None:
    """A fill that ends only after its step's forward pass has returned: the runner must wait
    for it, not sample with the last step's mask. (The fill waits for the forward pass, so the
    order holds however fast either runs.)"""
    done = threading.Condition()
    count = {"forwards": 0, "fills": 0, "late_fills": 0}
    step_forward = {}  # the mask thread's fill -> the number of forwards that must have ended
    forward, fill = type(model[0]).forward, BatchMask.fill
    start_mask = ModelRunner._start_grammar_mask

    def counted_forward(self, *args, **kwargs):
        try:
            return forward(self, *args, **kwargs)
        finally:
            with done:
                count["forwards"] += 1
                done.notify_all()

    def noted_start_mask(self, reqs, firsts, drafts):
        with done:  # on the runner's thread, before this step's forward pass
            step_forward["target"] = count["forwards"] + 1
        return start_mask(self, reqs, firsts, drafts)

    def late_fill(self, grammars, rows) -> None:
        with done:
            target = step_forward["target"]
            count["fills"] += 1
            # Bounded: were the runner waiting for this fill before its forward pass, the
            # step would hang; the count below then fails the test instead.
            if done.wait_for(lambda: count["forwards"] >= target, timeout=60):
                count["late_fills"] += 1
        fill(self, grammars, rows)

    monkeypatch.setattr(type(model[0]), "forward", counted_forward)
    monkeypatch.setattr(ModelRunner, "_start_grammar_mask", noted_start_mask)
    monkeypatch.setattr(BatchMask, "fill", late_fill)
    assert _generate(model, tokenizer, backends, overlap=True) == serial
    assert count["late_fills"] == count["fills"] > 0


def test_outputs_follow_constraints_and_free_rows_are_independent(
    model, tokenizer, backends, serial
) -> None:
    texts = {REQUESTS[i][1:3]: tokenizer.decode(ids, skip_special_tokens=True)
             for i, ids in enumerate(serial) if REQUESTS[i][0] is not None}
    for (kind, text), output in texts.items():
        if kind == "regex":
            assert re.fullmatch(text, output), output
        elif kind == "choice":
            assert output in CHOICES
    person = texts[("json_schema", PERSON)]
    if len(serial[0]) < MAX_NEW_TOKENS:  # it ended: complete JSON
        assert set(json.loads(person)) >= {"name", "age", "city"}
    alone = _generate(model, tokenizer, backends, overlap=True, only_unconstrained=True)
    assert alone == [ids for i, ids in enumerate(serial) if REQUESTS[i][0] is None]
