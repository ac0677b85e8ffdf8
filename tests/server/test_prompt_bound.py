"""The byte-length bound on token counts (``server.prompt_bound``): the shrink factors are
Unicode's, the bound holds for real tokenizers on adversarial text (the longest tokens repeated,
Hangul jamo and KELVIN SIGN through NFKC), tokenizers that can swallow text get no bound, and a
prompt far over the context is refused before it is tokenized."""

from __future__ import annotations

import unicodedata

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.prompt_bound import SHRINK, PromptBound, bound_from_spec, prompt_bound
from splitserve.server.routes import create_app

BPE = {"type": "BPE", "vocab": {"ab": 0, "a": 1, "b": 2}, "merges": [], "unk_token": None}


def _per_char(form) -> tuple[float, float]:
    """(most a character grows, most it shrinks) under ``form``, in UTF-8 bytes."""
    grow = shrink = 1.0
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        a, b = len(c.encode()), len(form(c).encode())
        grow, shrink = max(grow, b / a), max(shrink, a / b)
    return grow, shrink


def test_shrink_factors_are_unicodes() -> None:
    grow_d, shrink_d = _per_char(lambda c: unicodedata.normalize("NFD", c))
    grow_kd, shrink_kd = _per_char(lambda c: unicodedata.normalize("NFKD", c))
    assert SHRINK["NFD"] == shrink_d and SHRINK["NFKD"] == shrink_kd
    # X and NFC(X) share one NFD: len(X) <= shrink * len(NFD) <= shrink * grow * len(NFC(X)).
    assert SHRINK["NFC"] == shrink_d * grow_d and SHRINK["NFKC"] == shrink_kd * grow_kd
    assert SHRINK["Lowercase"] == _per_char(str.lower)[1]


@pytest.mark.parametrize("spec, why", [
    ({"added_tokens": [{"content": "<mask>", "lstrip": True}], "model": BPE}, "strips"),
    ({"normalizer": {"type": "Strip"}, "model": BPE}, "Strip"),
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"},
                                                          {"type": "StripAccents"}]},
      "model": BPE}, "StripAccents"),
    ({"normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "},
      "model": BPE}, "Replace"),
    ({"pre_tokenizer": {"type": "Whitespace"}, "model": BPE}, "Whitespace"),
    ({"pre_tokenizer": {"type": "Split", "behavior": "Removed"}, "model": BPE}, "removes"),
    ({"model": {**BPE, "unk_token": "<unk>"}}, "unk"),
    ({"model": BPE}, "or none"),  # no unk, no byte fallback: unknown text is dropped
    ({"model": {"type": "WordPiece", "vocab": {}}}, "WordPiece"),
])
def test_tokenizers_that_can_swallow_text_have_no_bound(spec, why) -> None:
    bound = bound_from_spec(spec)
    assert bound.max_bytes_per_token is None and why in bound.why
    assert bound.min_tokens(10**9) == 0


def test_bound_from_the_longest_token_and_the_normalizers() -> None:
    byte_level = {"pre_tokenizer": {"type": "ByteLevel"}, "model": {
        **BPE, "vocab": {"ĠĠĠĠ": 0, "a": 1}}}
    assert bound_from_spec(byte_level).max_bytes_per_token == 4  # characters, one per byte
    nfc = {**byte_level, "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "NFC"}, {"type": "Lowercase"}, {"type": "Prepend", "prepend": "▁"}]}}
    assert bound_from_spec(nfc).max_bytes_per_token == 4 * 9 * 3
    spm = {"pre_tokenizer": {"type": "Metaspace"}, "model": {
        "type": "Unigram", "vocab": [["▁the", 0.0], ["<0x0A>", 0.0]], "unk_id": 0,
        "byte_fallback": True}}
    assert bound_from_spec(spm).max_bytes_per_token == 6  # UTF-8 bytes of "<0x0A>"
    added = {**byte_level, "added_tokens": [{"content": "<|a much longer special|>"}]}
    assert bound_from_spec(added).max_bytes_per_token == len("<|a much longer special|>")


def _adversarial(pieces: list[str]) -> st.SearchStrategy[str]:
    return st.lists(st.one_of(st.sampled_from(pieces), st.text(max_size=8)),
                    max_size=40).map("".join)


def _check_holds(tokenizer, bound: PromptBound, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    counted = bound.counted_bytes(text.encode("utf-8", "surrogatepass"))
    assert len(ids) >= bound.min_tokens(counted), text


def test_bytes_the_default_tokenizer_drops_are_not_counted(tokenizer, smol_bound) -> None:
    """SmolLM2's byte-level vocabulary lacks a few control bytes: BPE drops them without a token
    (found by the property test below: ``'\x06'`` is no token at all)."""
    for text in ("\x06", "a\x06b", "\x04\x06\x13\x14\x16\x1d" * 1000):
        _check_holds(tokenizer, smol_bound, text)
    assert smol_bound.counted_bytes(b"\x06" * 10**6) == 0
    assert smol_bound.counted_bytes("a\x06b世".encode()) == 5
    for b in range(128):  # exactly the ASCII bytes with no token are not counted
        none = not tokenizer.encode(chr(b), add_special_tokens=False)
        assert none == (b in smol_bound.dropped), b


def test_the_default_models_bound_holds_on_its_longest_tokens(tokenizer) -> None:
    bound = prompt_bound(tokenizer)
    assert bound.max_bytes_per_token is not None, bound.why
    vocab = tokenizer.get_vocab()
    longest = sorted(vocab, key=len)[-20:]
    texts = [tokenizer.convert_tokens_to_string([t]) for t in longest]
    for text in texts:
        _check_holds(tokenizer, bound, text * 50)
    # The bound is tight: the longest token, repeated, is one token per repeat.
    top = tokenizer.convert_tokens_to_string([longest[-1]])
    assert len(top.encode()) == bound.max_bytes_per_token
    assert bound.min_tokens(len((top * 3).encode())) == 3


@pytest.fixture(scope="module")
def smol_bound(tokenizer) -> PromptBound:
    return prompt_bound(tokenizer)  # reads the whole tokenizer.json: once per module


@settings(max_examples=200, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_default_models_bound_holds_on_any_text(tokenizer, smol_bound, data) -> None:
    pieces = ["\n" + " " * 80, " " * 200, "<|im_start|>", "🚀", "世界", "\u212a" * 3, "ᄀ" * 5]
    _check_holds(tokenizer, smol_bound, data.draw(_adversarial(pieces)))


@pytest.fixture(scope="module")
def nfkc_tokenizer():
    """A real ``tokenizers`` BPE behind NFKC + lowercase + ByteLevel, trained on text that
    normalization shrinks (compatibility characters, Hangul jamo), wrapped for transformers."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["\u212a" * 40, "\uff21" * 40, "\u1100\u1161\u11a8" * 30, "ﬁ" * 30, "the cat " * 20]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(corpus * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_bound_holds_through_nfkc_and_lowercase(nfkc_tokenizer, data) -> None:
    bound = prompt_bound(nfkc_tokenizer)
    assert bound.max_bytes_per_token is not None, bound.why
    pieces = ["\u212a" * 40, "\uff21" * 40, "\u1100\u1161\u11a8" * 30, "ﬁ" * 30, "\ufdfa"]
    _check_holds(nfkc_tokenizer, bound, data.draw(_adversarial(pieces)))


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(tokenizer) -> None:
    class Counting:
        """The tokenizer, counting the texts it is asked to encode (and their size)."""

        def __init__(self, inner) -> None:
            self.inner, self.encoded = inner, []

        def encode(self, text, **kw):
            self.encoded.append(len(text))
            return self.inner.encode(text, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __len__(self) -> int:
            return len(self.inner)

    counting = Counting(tokenizer)
    fake = FakeEngineClient(tokenizer, tokenizer.eos_token_id)
    app = create_app(fake, counting, "m", 2048, [tokenizer.eos_token_id])
    client = TestClient(app)
    big = "The quick brown fox jumps over the lazy dog. " * 80_000  # 3.6 MB
    for path, body in [("/v1/completions", {"model": "default", "prompt": big}),
                       ("/v1/chat/completions", {"model": "default",
                                                 "messages": [{"role": "user", "content": big}]}),
                       ("/tokenize", {"model": "default", "prompt": big})]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text
    assert all(n < 10_000 for n in counting.encoded), counting.encoded  # never the big text
    assert not fake.requests
    # Just under the bound: tokenized, then refused by its real count.
    bound = prompt_bound(tokenizer).max_bytes_per_token
    under = "a" * int(bound * 2047)
    r = client.post("/v1/completions", json={"model": "default", "prompt": under})
    assert r.status_code == 400 and "tokens; the context length is 2048" in r.text
