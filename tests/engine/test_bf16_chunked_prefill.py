"""A prompt longer than the step's token budget, alone, in bfloat16 with the C kernels: its first
chunks finish no prompt, so those steps score no row (a worker crashed on the empty LM-head
product). The chunked run's first token and its logprob match the unchunked run's (later tokens
may part: in bfloat16 a row's sums depend on the step's row count, docs/serving.md "Determinism")."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_pool import KVPool
from tests.cpu_kernels import load_or_fail

pytestmark = pytest.mark.skipif(load_or_fail() is None, reason="no C compiler")


def test_prompt_over_the_token_budget_prefills_in_chunks(model_path) -> None:
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.sched.request import Req
    from splitserve.ipc.messages import SamplingParams
    from tests.engine_core import make_core

    model, cfg = load_model(model_path, dtype=torch.bfloat16)
    prompt = torch.randint(100, 40000, (150,), generator=torch.Generator().manual_seed(1))

    def run(budget: int) -> tuple[Req, int]:
        model.attn_backend.decode_cache = None
        pool = KVPool(cfg.kv_layout(16, "bfloat16"), 64)
        core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=budget)
        sched = core.scheduler
        params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        req = Req(rid="long", input_ids=prompt.tolist(), sampling=params)
        sched.add(req)
        silent = 0
        while sched.has_work:
            silent += not core.step()
        assert pool.allocator.num_used == 0  # every page back
        return req, silent

    chunked, silent_steps = run(64)  # 64 + 64 + 22 tokens: two steps sample nothing
    whole, _ = run(2048)
    assert silent_steps == 2
    assert len(chunked.output_ids) == 8
    assert chunked.output_ids[0] == whole.output_ids[0]
    # The LM head's output is bfloat16: logits of 8-32 are 0.0625-0.125 apart.
    assert abs(chunked.output_logprobs[0] - whole.output_logprobs[0]) < 0.25
