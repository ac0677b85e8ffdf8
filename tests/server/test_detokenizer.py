"""Incremental detokenization against the real SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from splitserve.server.detokenizer import IncrementalDetokenizer

MULTIBYTE = "héllo 世界 🚀 naïve café — 日本語のテキスト 👩‍👩‍👧 done"


def stream(tokenizer, ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    """Push ``ids`` in chunks and return every piece, the flush last."""
    det = IncrementalDetokenizer(tokenizer)
    pieces, i, sizes = [], 0, iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        pieces.append(det.push(ids[i : i + n]))
        i += n
    pieces.append(det.flush())
    return pieces


def test_multibyte_one_token_at_a_time(tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == MULTIBYTE == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
    # The emoji really is split over several tokens, so holding back was needed.
    assert len(tokenizer.encode("🚀", add_special_tokens=False)) > 1


def test_special_tokens_are_skipped(tokenizer) -> None:
    body = tokenizer.encode("hi 世界", add_special_tokens=False)
    ids = [tokenizer.convert_tokens_to_ids("<|im_start|>"), *body, tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)) == "hi 世界"


@pytest.mark.parametrize("seed", range(20))
def test_random_token_sequences_match_full_decode(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    # Mix random ids (arbitrary byte fragments, some special) with real multi-byte text.
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    ids[rng.randrange(len(ids)) :] += tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    sizes = [rng.randint(1, 4) for _ in ids]
    pieces = stream(tokenizer, ids, sizes)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    # Only the final flush may end in a replacement char (a character never completed).
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_empty_push_and_double_flush(tokenizer) -> None:
    det = IncrementalDetokenizer(tokenizer)
    assert det.push([]) == ""
    assert det.flush() == ""
    ids = tokenizer.encode("ok", add_special_tokens=False)
    assert det.push(ids) + det.flush() + det.flush() == "ok"


class _WindowRecorder:
    """A tokenizer without the Rust backend that records how many ids each decode sees."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.window_lens: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.window_lens.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_is_bounded(tokenizer) -> None:
    recorder = _WindowRecorder(tokenizer)
    ids = tokenizer.encode(MULTIBYTE * 30, add_special_tokens=False)
    pieces = stream(recorder, ids)
    assert "".join(pieces) == MULTIBYTE * 30
    # O(window), not O(output): no decode ever sees more than a few tokens.
    assert max(recorder.window_lens) <= 8 < len(ids)


def test_cut_inside_a_character_drops_the_fragment(tokenizer) -> None:
    # An output cut at max_tokens part-way through a multi-byte character (issue 17, item 6).
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    cuts = [n for n in range(1, len(ids))
            if tokenizer.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd")]
    assert cuts, "the sample must split some character over tokens"
    for n in cuts:
        det = IncrementalDetokenizer(tokenizer)
        text = det.push(ids[:n]) + det.flush(cut=True)
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert text == full.rstrip("\ufffd") and not text.endswith("\ufffd"), n
        uncut = IncrementalDetokenizer(tokenizer)
        assert uncut.push(ids[:n]) + uncut.flush() == full  # a finished output shows it all


def test_stream_text_at_a_length_cut_has_no_replacement_char(tokenizer) -> None:
    import anyio

    from splitserve.ipc.messages import SamplingParams
    from splitserve.server.engine_client import TokenEvent
    from splitserve.server.formatter import ResponseFormatter, Usage
    from splitserve.server.generation import stream_text
    from splitserve.server.job import Job

    ids = tokenizer.encode("ok 🚀", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids))
               if tokenizer.decode(ids[:n]).endswith("\ufffd"))

    class Client:
        async def generate(self, rid, input_ids, sampling, cache_namespace=None):
            for i, token in enumerate(ids[:cut]):
                yield TokenEvent([token], [0.0], "length" if i == cut - 1 else None)

        async def abort(self, rid):
            pass

    job = Job("r", [1], SamplingParams(), [], ResponseFormatter("r", 0, "m", False, False),
              Usage(1))

    async def main() -> str:
        return "".join([p.text async for p in stream_text(Client(), tokenizer, job)])

    assert anyio.run(main) == "ok "
