"""Speculative decoding (``--speculative ngram``): the n-gram drafter, the verifier and the engine.

- The drafter proposes what followed the latest earlier occurrence of the longest suffix n-gram.
- Greedy verification keeps exactly the draft prefix the argmax agrees with.
- Rejection sampling's output distribution equals the target's, checked by counting on a toy
  vocabulary (accept and reject branches, and the token after a kept draft).
- The real default model in-process: the same greedy tokens with and without drafts (float32;
  colocated scheduler; radix cache on), drafts actually kept, every page back; a seeded sampled
  request repeats itself exactly.
- In bfloat16 with the C kernels a verify step runs the fused decode layers, one decode row per
  drafted position: its logits at every drafted position are the extend path's (within bfloat16
  rounding, the same argmax), and a sequence is copied into the decode cache once, not after
  every partly rejected draft.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_pool import KVPool
from splitserve.engine.runner.verify import verify_drafts
from splitserve.engine.sched.ngram import NgramIndex
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from tests.engine_core import make_core


def _propose(seq: list[int], k: int, index: NgramIndex | None = None, **kw) -> list[int]:
    index = index or NgramIndex(**kw)
    return index.propose(lambda a, b: seq[a:b], len(seq), k)


def test_ngram_proposes_the_continuation_of_the_latest_match() -> None:
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # suffix [1, 2, 3] last occurred at 5..7, followed by 7, 8, 5, 1 ...
    assert _propose(seq, 3) == [7, 8, 5]
    assert _propose(seq, 10) == [7, 8, 5, 1, 2, 3]  # runs up to the end of the sequence
    assert _propose(seq, 0) == []
    assert _propose([4, 5, 6], 3) == []  # no earlier occurrence
    # The longest n wins: [2, 3] alone would also match at 1..2 (-> 9), but [1, 2, 3] is tried
    # first and matches the later occurrence.
    assert _propose([5, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 1, max_n=3) == [4]
    assert _propose([5, 2, 3, 9, 1, 2, 3, 4, 8, 2, 3], 1, max_n=3) == [4]  # [2, 3]'s latest
    assert _propose([5, 2, 3, 9, 1, 2, 3, 4, 8, 2, 3], 1, max_n=3, min_n=3) == []


def test_ngram_index_grows_incrementally_as_from_scratch() -> None:
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 6, (300,), generator=gen).tolist()
    index = NgramIndex(max_n=4, min_n=2)
    for end in range(1, len(seq) + 1):
        grown = index.propose(lambda a, b: seq[a:b], end, 5)
        fresh = _propose(seq[:end], 5, max_n=4, min_n=2)
        assert grown == fresh, end


def test_ngram_index_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError):
        NgramIndex(max_n=1, min_n=2)
    with pytest.raises(ValueError):
        NgramIndex(max_n=3, min_n=0)


def _logits_favouring(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        out[i, t] = 5.0
    return out


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_verification_keeps_the_agreeing_prefix() -> None:
    # Argmax per position: 3, 4, 6, 1. Draft 3, 4, 5: two kept, then the model's 6.
    logits = _logits_favouring([3, 4, 6, 1])
    (res,) = verify_drafts(logits, [[3, 4, 5]], [GREEDY], [0])
    assert (res.tokens, res.accepted) == ([3, 4, 6], 2)
    (res,) = verify_drafts(logits, [[3, 4, 6]], [GREEDY], [0])
    assert (res.tokens, res.accepted) == ([3, 4, 6, 1], 3)  # all kept, plus the bonus token
    (res,) = verify_drafts(logits[:2], [[0]], [GREEDY], [0])
    assert (res.tokens, res.accepted) == ([3], 0)
    want = torch.log_softmax(logits, -1)[[0, 1, 2], [3, 4, 6]]
    (res,) = verify_drafts(logits, [[3, 4, 5]], [GREEDY], [0])
    assert res.logprobs == pytest.approx(want.tolist())
    # Rows are independent; an empty draft is one plain greedy step.
    both = verify_drafts(torch.cat([logits, logits[:1]]), [[3, 4, 5], []], [GREEDY] * 2, [0, 0])
    assert [r.tokens for r in both] == [[3, 4, 6], [3]]
    with pytest.raises(ValueError):
        verify_drafts(logits, [[3]], [GREEDY], [0])


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return float((counts / counts.sum() - probs).abs().sum() / 2)


@pytest.mark.parametrize("draft_token", [0, 2])  # a likely draft (mostly kept), an unlikely one
def test_rejection_sampling_keeps_the_target_distribution(draft_token: int) -> None:
    """First token ~ p0 whatever the draft; given the draft was kept, the next ~ p1."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5], [0.0, 1.5, 0.3, -0.5]])
    probs = torch.softmax(logits / 0.8, -1)
    n = 8_000
    first = torch.zeros(4)
    second = torch.zeros(4)
    kept = 0
    for seed in range(n):
        p = SamplingParams(temperature=0.8, top_p=1.0, seed=seed)
        (res,) = verify_drafts(logits, [[draft_token]], [p], [0])
        first[res.tokens[0]] += 1
        if res.accepted:
            kept += 1
            second[res.tokens[1]] += 1
    assert _tv(first, probs[0]) < 0.02, (first / n, probs[0])
    assert abs(kept / n - float(probs[0, draft_token])) < 0.02
    if kept > 1500:
        assert _tv(second, probs[1]) < 0.03, (second / kept, probs[1])


def test_rejection_sampling_honours_top_k() -> None:
    """A draft outside top-k is never kept, and the token drawn instead is inside it."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    for seed in range(300):
        p = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        (res,) = verify_drafts(logits, [[3]], [p], [0])
        assert res.accepted == 0 and res.tokens[0] in (0, 1)


def test_seeded_verification_repeats() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, seed=7)
    a = verify_drafts(logits, [[1, 2, 3, 4]], [p], [10])
    b = verify_drafts(logits, [[1, 2, 3, 4]], [p], [10])
    assert a == b


# ---- the real model, in-process ---------------------------------------------------------------

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
TEXTS = [
    f"Rename add to plus and print the whole code again:\n{CODE}",
    "Count from 1 to 20 separated by commas: 1, 2, 3,",
]


def _run_alone(core, req: Req, pool: KVPool) -> list[int]:
    """Run ``req`` alone on ``core`` to its end; its output ids (every page freed after)."""
    core.scheduler.add(req)
    while core.scheduler.has_work:
        core.step()
    assert pool.allocator.num_used == 0
    return req.output_ids


def _prompt_ids(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(chat, add_special_tokens=False)["input_ids"])


def _generate(model, cfg, prompts, params, cache: str = "none", **engine):
    """All prompts at once through one core; returns (outputs, scheduler)."""
    model.attn_backend.decode_cache = None
    pool = KVPool(cfg.kv_layout(16, "float32"), 200)
    core = make_core(model, pool, cfg.eos_token_ids, cache=cache, **engine)
    reqs = [Req(rid=f"r{i}", input_ids=p, sampling=params) for i, p in enumerate(prompts)]
    for r in reqs:
        core.scheduler.add(r)
    while core.scheduler.has_work:
        core.step()
    core.scheduler.cache.flush()
    assert pool.allocator.num_used == 0, "pages leaked"
    return [r.output_ids for r in reqs], core.scheduler


@pytest.mark.usefixtures("one_thread")
def test_greedy_output_is_plain_greedy_output(model, tokenizer) -> None:
    net, cfg = model
    prompts = [_prompt_ids(tokenizer, t) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    plain, _ = _generate(net, cfg, prompts, params)
    spec, sched = _generate(net, cfg, prompts, params, cache="radix", speculative="ngram",
                            num_speculative_tokens=4, speculative_max_running=4)
    assert spec == plain
    # The code is copied back: drafts are kept, and steps were saved.
    assert sched.num_accepted_tokens >= 10, (sched.num_draft_tokens, sched.num_accepted_tokens)
    assert sched.num_accepted_tokens <= sched.num_draft_tokens


@pytest.mark.usefixtures("one_thread")
def test_seeded_sampling_with_drafts_repeats(model, tokenizer) -> None:
    net, cfg = model
    prompts = [_prompt_ids(tokenizer, TEXTS[0])]
    params = SamplingParams(temperature=0.7, seed=11, max_new_tokens=16)
    kw = {"speculative": "ngram", "num_speculative_tokens": 3}
    a, sched = _generate(net, cfg, prompts, params, **kw)
    b, _ = _generate(net, cfg, prompts, params, **kw)
    assert a == b and len(a[0]) == 16
    assert sched.num_draft_tokens > 0


@pytest.mark.usefixtures("one_thread")
def test_drafts_stop_at_max_tokens_and_above_max_running(model, tokenizer) -> None:
    net, cfg = model
    prompts = [_prompt_ids(tokenizer, TEXTS[1])] * 3
    params = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)
    plain, _ = _generate(net, cfg, prompts, params)
    spec, sched = _generate(net, cfg, prompts, params, speculative="ngram",
                            speculative_max_running=2)
    assert spec == plain and all(len(o) == 9 for o in spec)
    assert sched.num_draft_tokens == 0  # three decoding at once: above the limit of two


@pytest.mark.usefixtures("one_thread")
def test_constrained_output_with_drafts_is_plain_constrained_output(model, tokenizer) -> None:
    """Drafts of a constrained row are cut to what its grammar accepts and verified under the
    masks at every drafted position: the same tokens as plain constrained greedy, valid JSON,
    and drafts were kept (the object is copied from the prompt)."""
    import json

    import jsonschema

    from splitserve.engine.grammar.request_grammar import RequestGrammar
    from splitserve.engine.grammar.xgrammar_backend import XGrammarBackend

    net, cfg = model
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "items": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "items"], "additionalProperties": False}
    backend = XGrammarBackend(tokenizer)
    compiled = backend.compile("json_schema", json.dumps(schema))
    text = 'Copy this JSON: {"name": "Alice", "items": ["apple", "pear", "plum", "fig"]}'
    prompt = _prompt_ids(tokenizer, text)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)

    def run(**engine):
        net.attn_backend.decode_cache = None
        pool = KVPool(cfg.kv_layout(16, "float32"), 64)
        core = make_core(net, pool, cfg.eos_token_ids, runner={"vocab_size": cfg.vocab_size},
                         **engine)
        req = Req(rid="c", input_ids=prompt, sampling=params)
        req.grammar = RequestGrammar(
            compiled.create_matcher(max_rollback_tokens=64), cfg.vocab_size,
            list(cfg.eos_token_ids), lambda s: tokenizer.encode(s, add_special_tokens=False),
        )
        return _run_alone(core, req, pool), core.scheduler

    plain, _ = run()
    spec, sched = run(speculative="ngram", num_speculative_tokens=4)
    assert spec == plain
    jsonschema.validate(json.loads(tokenizer.decode(spec, skip_special_tokens=True)), schema)
    assert sched.num_accepted_tokens > 0, (sched.num_draft_tokens, sched.num_accepted_tokens)


# ---- bfloat16: verify steps on the fused decode path -------------------------------------------


@pytest.fixture(scope="module")
def bf16_model(model_path):
    """The default model in bfloat16 with the C products at every step size (``--kernels c``:
    the fused decode layers need them, and a verify step's rows need the AVX512_BF16 tiles
    beyond the skinny kernel's 2 rows), or a skip without a C compiler or those CPU flags."""
    from splitserve.config import EngineConfig
    from splitserve.engine.model.loader import load_model
    from tests.cpu_kernels import BF16_KERNEL_FLAGS, check_kernel, load_or_fail

    kernels = load_or_fail()
    check_kernel(kernels, kernels is not None and kernels.has_gemm, BF16_KERNEL_FLAGS,
                 "bfloat16 decode tiles (verify rows)")
    return load_model(model_path, dtype=torch.bfloat16, engine=EngineConfig(kernels="c"))


def _spy_fused(monkeypatch) -> list[tuple[bool, list[int]]]:
    """Record each forward pass of the model: (whether the fused decode layers ran, the step's
    sequence ids)."""
    from splitserve.engine.model.base import DecoderLM
    from splitserve.engine.model.fused_decode import FusedDecodeLayers

    calls: list[tuple[bool, list[int]]] = []
    runs = [0]
    real_run, real_forward = FusedDecodeLayers.run, DecoderLM.forward

    def run(self, *args, **kwargs):
        ran = real_run(self, *args, **kwargs)
        runs[0] += ran
        return ran

    def forward(self, batch, *args, **kwargs):
        before = runs[0]
        out = real_forward(self, batch, *args, **kwargs)
        calls.append((runs[0] > before, list(batch.seq_ids or [])))
        return out

    monkeypatch.setattr(FusedDecodeLayers, "run", run)
    monkeypatch.setattr(DecoderLM, "forward", forward)
    return calls


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # kv_append_bf16, kv_append_q8
def test_verify_rows_on_the_decode_path_equal_the_extend_path(bf16_model, tokenizer,
                                                              monkeypatch, kv_cache_dtype) -> None:
    """One sequence's verify step (its missing token and four drafts) as an extend and as five
    decode rows sharing its cache slot, over the same pool: the fused layers run the second,
    and the logits at every drafted position agree within bfloat16 rounding (different
    attention kernels and product shapes), with the same argmax. Then a plain decode step
    after a partial acceptance reads the slot as is: its logits equal those of the same step
    over a fresh copy of the sequence from the pool (bfloat16; an int8 pool is read in place,
    with no decode cache)."""
    from splitserve.engine.attention.decode_kv_cache import DecodeKVCache
    from splitserve.engine.forward_batch import build_forward_batch
    from splitserve.engine.kv_pool import pages_for

    net, cfg = bf16_model
    net.attn_backend.decode_cache = None
    calls = _spy_fused(monkeypatch)
    ids = _prompt_ids(tokenizer, TEXTS[0])
    prefix, chunk = ids[:-5], ids[-5:]  # the chunk: a "missing token" and four drafts
    pool = KVPool(cfg.kv_layout(16, "bfloat16", kv_cache_dtype), 32)
    pages = pool.allocator.alloc(pages_for(len(ids) + 1, 16))

    def step(tokens, start, counts=None, as_decode_rows=False):
        batch = build_forward_batch([tokens], [start], [pages], 16, [0], seq_ids=[7],
                                    logit_counts=counts, max_seq_lens=[len(ids) + 8])
        return net(batch.as_decode_rows() if as_decode_rows else batch, pool)

    step(prefix, 0)
    extend = step(chunk, len(prefix), [5])
    assert not any(ran for ran, _ in calls)
    decode = step(chunk, len(prefix), [5], as_decode_rows=True)
    assert calls[-1] == (True, [7] * 5)
    assert extend.shape == decode.shape == (5, cfg.vocab_size)
    diff = (extend - decode).abs().max().item()
    # Measured 0.81 (2026-12-03, Zen 5) on logits of magnitude ~20: bfloat16 hidden states
    # through 30 layers of different attention kernels and product shapes.
    assert diff < 1.5, diff
    assert torch.equal(extend.argmax(-1), decode.argmax(-1))
    # Two drafts kept, then another token than the third draft: the next step's row sits at
    # len(prefix) + 3, inside the slot's 5 positions, over the rejected draft's stale K/V.
    copies: list[int] = []
    real_fill = DecodeKVCache._fill
    monkeypatch.setattr(DecodeKVCache, "_fill",
                        lambda self, *a: copies.append(a[1]) or real_fill(self, *a))
    bonus = chunk[3] + 1
    after = step([bonus], len(prefix) + 3)
    assert calls[-1] == (True, [7]) and copies == []
    if kv_cache_dtype == "int8":  # read in place (decode_attention_q8.c): there is no slot
        assert net.attn_backend.decode_cache is None
        return
    net.attn_backend.decode_cache = None  # the same step over a fresh copy from the pool
    fresh = step([bonus], len(prefix) + 3)
    assert copies == [len(prefix) + 3]
    assert torch.equal(after, fresh)


@pytest.mark.usefixtures("one_thread")
def test_bf16_verify_steps_take_the_fused_path_without_recopies(bf16_model, tokenizer,
                                                                monkeypatch) -> None:
    """Speculative greedy decoding in bfloat16 through the scheduler: every verify step runs
    the fused decode layers (rows sharing the sequence's id), the sequence is copied into the
    decode cache once (when it starts decoding), drafts are kept, and the tokens are those of
    plain greedy decoding on the same path. (Not guaranteed in bfloat16: a verify step's rows
    go through the products at another row count than a plain step's single row; on this
    prompt they agree.)"""
    from splitserve.engine.attention.decode_kv_cache import DecodeKVCache

    net, cfg = bf16_model
    calls = _spy_fused(monkeypatch)
    copies: list[int] = []
    real_fill = DecodeKVCache._fill
    monkeypatch.setattr(DecodeKVCache, "_fill",
                        lambda self, *a: copies.append(a[1]) or real_fill(self, *a))
    prompt = _prompt_ids(tokenizer, TEXTS[0])
    params = SamplingParams(temperature=0.0, max_new_tokens=40)

    def run(**engine):
        net.attn_backend.decode_cache = None
        pool = KVPool(cfg.kv_layout(16, "bfloat16"), 64)
        core = make_core(net, pool, cfg.eos_token_ids, **engine)
        req = Req(rid="b", input_ids=prompt, sampling=params)
        return _run_alone(core, req, pool), core.scheduler

    plain, _ = run()
    calls.clear()
    copies.clear()
    spec, sched = run(speculative="ngram", num_speculative_tokens=4)
    verify_steps = [ran for ran, ids in calls if len(ids) > 1]
    assert verify_steps and all(ran for ran, _ in calls[1:]), calls  # all but the prompt step
    assert sched.num_accepted_tokens >= 10, (sched.num_draft_tokens, sched.num_accepted_tokens)
    assert copies == [len(prompt)], copies  # once, at the first decode step
    assert spec == plain
