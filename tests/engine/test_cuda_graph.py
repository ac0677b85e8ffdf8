"""Decode steps through ``engine.cuda_graph`` equal the eager forward, padding rows included.

On CUDA the graphs are captured and replayed (bench/gpu_check.sh runs this file there). Without
CUDA the same static-buffer path runs eagerly with the Triton kernels under ``TRITON_INTERPRET=1``:
that checks what padding a batch to a captured size does (scratch-page writes, one-token attention
for padding rows, logits of the real rows only), not the capture itself.
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_device import DEVICE  # first: it sets TRITON_INTERPRET before Triton loads

from splitserve.engine.attention.base import create_attention_backend
from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVPool, pages_for
from splitserve.engine.model.loader import load_model
from splitserve.engine.runner.cuda_graph import DecodeGraphRunner
from splitserve.engine.step_plan import ProductLimits, StepShape, plan_step

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE_SIZE = 4
SIZES = (1, 2, 4, 8)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral_window": ("MistralConfig", {"sliding_window": 6}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    """A tiny random model of that architecture on ``DEVICE`` with the Triton backend."""
    import transformers

    cls_name, extra = CONFIGS[request.param]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, **extra,
    )  # fmt: skip
    path = tmp_path_factory.mktemp(request.param)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    model, config = load_model(path, torch.float32, DEVICE, create_attention_backend("triton"))
    return model, config


def _decode_batch(lens: list[int], pages: list[list[int]], seed: int):
    """A decode step for sequences of KV length ``lens`` (new token included)."""
    rng = random.Random(seed)
    return build_forward_batch(
        [[rng.randrange(96)] for _ in lens],
        [n - 1 for n in lens],
        pages,
        PAGE_SIZE,
        list(range(len(lens))),
        DEVICE,
    )


def _replays(runner: DecodeGraphRunner, batch, sample_rows: list[int], scored: list[int]) -> bool:
    """Whether the step plan replays ``batch`` in ``runner``'s graphs (the model runner's
    question, on a device with no C products)."""
    shape = StepShape.of(batch, sample_rows, scored)
    return plan_step(shape, ProductLimits(), False, runner.limits).replay_graph


# (rows, then fewer rows in the same captured size: 1, 4, 8, 8)
@pytest.mark.parametrize("num_seqs, fewer", [(1, 1), (4, 3), (7, 5), (8, 5)])
def test_graph_decode_equals_eager(model, num_seqs: int, fewer: int) -> None:
    model, config = model
    pool = KVPool(config.kv_layout(PAGE_SIZE, "float32"), 96, DEVICE)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(1)))
    runner = DecodeGraphRunner(model, pool, SIZES, capture=DEVICE == "cuda")
    rng = random.Random(num_seqs)
    free = list(range(1, 96))
    rng.shuffle(free)  # non-contiguous pages, as after real traffic
    lens = [rng.randrange(1, 20) for _ in range(num_seqs)]
    pages = []
    for n in lens:
        k = pages_for(n + 3, PAGE_SIZE)  # room for three decode steps
        pages.append(free[:k])
        free = free[k:]
    for step in range(3):
        # All rows, then fewer: the smaller batch reuses buffers that the larger one left
        # holding real page ids, so stale rows must be padded away (or they would write into
        # pages since handed to other sequences).
        for rows in (num_seqs, fewer):
            # The dropped rows' pages now belong to someone else: new content, not to be touched.
            for p in (q for row in pages[rows:] for q in row):
                pool.buffer[p].normal_()
            batch = _decode_batch([n + step for n in lens[:rows]], pages[:rows], seed=step)
            assert _replays(runner, batch, list(range(rows)), [])
            eager = model(batch, pool).cpu()
            after_eager = pool.buffer[1:].clone()  # page 0 is scratch: padding rows write there
            graph = runner.run(batch).cpu()
            assert graph.shape == eager.shape
            torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4)
            # The replay rewrote the real rows' K/V with the same values, nothing else.
            torch.testing.assert_close(pool.buffer[1:], after_eager, atol=1e-5, rtol=1e-5)


def test_graph_runner_refuses_what_it_cannot_replay(model) -> None:
    model, config = model
    pool = KVPool(config.kv_layout(PAGE_SIZE, "float32"), 64, DEVICE)
    runner = DecodeGraphRunner(model, pool, (1, 2), capture=DEVICE == "cuda")
    two = _decode_batch([5, 7], [[1, 2], [3, 4]], seed=0)
    assert _replays(runner, two, [0, 1], [])
    assert not _replays(runner, two, [1], [])  # not every row sampled
    assert not _replays(runner, two, [0, 1], [0])  # prompt logprobs wanted
    three = _decode_batch([5, 7, 2], [[1, 2], [3, 4], [5]], seed=0)
    assert not _replays(runner, three, [0, 1, 2], [])  # larger than any captured size
    extend = build_forward_batch([[1, 2]], [3], [[1, 2]], PAGE_SIZE, [0], DEVICE)
    assert not _replays(runner, extend, [0], [])  # not decode-only
    past = _decode_batch([config.context_len + 1], [list(range(1, 18))], seed=0)
    assert not _replays(runner, past, [0], [])  # the eager path raises the context error
