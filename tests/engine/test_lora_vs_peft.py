"""LoRA adapters in the engine against ``transformers`` + ``peft`` (float32, greedy): each
adapter alone, the base model unchanged, and one batch that mixes the base and three adapters
(all seven target modules, ranks 2-16, ``lora_alpha`` and rsLoRA scaling, rank and alpha
patterns) giving every row what the reference gives it. Then the adapters' checks: a wrong
hidden size, a missing file, a rank above the limit and an unsupported target are refused by
name; and the slots: with ``max_loras`` 1, three adapters alternate through one slot, every
request finishes and every page comes back.

The engine runs in-process (scheduler, runner, the real model) on its own copy of the model:
adapters change its projections, and the session's shared model must stay as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.config import EngineConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.lora.manager import LoraManager
from splitserve.engine.lora.peft import LoraError, read_adapter
from splitserve.engine.model.loader import load_model
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.messages import SamplingParams
from splitserve.radix_cache.prefix_cache import create_prefix_cache
from tests.lora_adapters import assert_greedy_matches, peft_greedy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPTS = ["The password is", "Arr, the pirate said", "Once upon a time"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(model_path, lora_adapters, prompts):
    return peft_greedy(model_path, lora_adapters, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def engine(model_path, lora_adapters):
    """``(model, config, manager)``: the model with every adapter loaded, 4 slots."""
    model, config = load_model(model_path, torch.float32)
    manager = LoraManager(model, max_loras=4, max_lora_rank=64)
    for name, path in lora_adapters.items():
        manager.load(name, str(path))
    return model, config, manager


def generate(engine, jobs: list[tuple[list[int], str | None]], radix: bool = False,
             max_loras: int | None = None) -> tuple[list[list[int]], list[set]]:
    """Greedy outputs of ``jobs`` (prompt ids, adapter name or None), all queued at once;
    and per step the set of slots its rows ran under (None: the base)."""
    model, config, manager = engine
    pool = KVPool(config.kv_layout(16, "float32"), 256, "cpu")
    cache = create_prefix_cache("radix" if radix else "none", pool.allocator, 16)
    scheduler = Scheduler(cache, EngineConfig(), config.eos_token_ids, lora=manager)
    core = EngineCore(scheduler, ModelRunner(model, pool, eos_token_ids=config.eos_token_ids))
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    reqs = [Req(f"r{i}", ids, sampling, lora=None if name is None else manager.get(name))
            for i, (ids, name) in enumerate(jobs)]
    for r in reqs:
        scheduler.add(r)
    steps = []
    while scheduler.has_work:
        batch = scheduler.schedule()
        assert batch is not None, "requests wait for a slot that never frees"
        steps.append({r.lora_slot for r in batch.reqs})
        scheduler.update(batch, core.runner.run(batch))
    scheduler.check_pages()
    assert pool.allocator.num_used == cache.stats().cached_pages  # every page came back
    assert all(s.refs == 0 for s in manager.slots.slots)
    return [r.output_ids for r in reqs], steps


@pytest.mark.parametrize("name", [None, "sql", "pirate", "wizard"])
def test_each_adapter_alone_equals_peft(engine, reference, prompts, name) -> None:
    for i, ids in enumerate(prompts):
        (out,), _ = generate(engine, [(ids, name)])
        assert_greedy_matches(reference[name][i], out)


def test_the_adapters_change_the_outputs(reference) -> None:
    for name in ("sql", "pirate", "wizard"):
        assert [t for t, _ in reference[name]] != [t for t, _ in reference[None]], name


def test_one_batch_mixing_three_adapters_and_the_base(engine, reference, prompts) -> None:
    names = [None, "sql", "pirate", "wizard"]
    jobs = [(ids, name) for ids in prompts for name in names]
    outs, steps = generate(engine, jobs)
    assert len(steps[0]) == 4, steps[0]  # the first step ran all four together
    for (ids, name), out in zip(jobs, outs, strict=True):
        assert_greedy_matches(reference[name][prompts.index(ids)], out)


def test_a_prefix_cached_under_one_adapter_is_no_hit_under_another(engine, prompts) -> None:
    model, config, manager = engine
    pool = KVPool(config.kv_layout(16, "float32"), 256, "cpu")
    cache = create_prefix_cache("radix", pool.allocator, 16)
    scheduler = Scheduler(cache, EngineConfig(), config.eos_token_ids, lora=manager)
    core = EngineCore(scheduler, ModelRunner(model, pool, eos_token_ids=config.eos_token_ids))
    from splitserve.radix_cache.namespace import adapter_namespace

    ids = prompts[0] * 12  # several pages
    cached = {}
    for name in ["sql", "sql", "pirate", None]:
        lora = None if name is None else manager.get(name)
        req = Req("r", ids, SamplingParams(max_new_tokens=2, temperature=0),
                  cache_namespace=adapter_namespace(None, None if lora is None else lora.digest),
                  lora=lora)
        scheduler.add(req)
        while scheduler.has_work:
            core.step()
        cached.setdefault(name, []).append(req.cached_len)
    assert cached["sql"][0] == 0 and cached["sql"][1] > 0  # a hit under the same adapter
    assert cached["pirate"] == [0] and cached[None] == [0]


@pytest.fixture(scope="module")
def spare_model(model_path):
    """Another copy of the model, for managers with other slot counts."""
    return load_model(model_path, torch.float32)


def test_one_slot_three_alternating_adapters(spare_model, lora_adapters, prompts,
                                             reference) -> None:
    """``max_loras`` 1: requests of three adapters and the base, interleaved, all finish with
    the reference's tokens; no step runs two adapters; the slot changes hands."""
    model, config = spare_model
    manager = LoraManager(model, max_loras=1, max_lora_rank=64)
    for name, path in lora_adapters.items():
        manager.load(name, str(path))
    names = ["sql", "pirate", "wizard", None] * 2
    jobs = [(prompts[i % len(prompts)], name) for i, name in enumerate(names)]
    outs, steps = generate((model, config, manager), jobs)
    for (ids, name), out in zip(jobs, outs, strict=True):
        assert_greedy_matches(reference[name][prompts.index(ids)], out)
    assert all(len(s - {None}) <= 1 for s in steps)
    assert manager.slots.num_evictions >= 2


def test_a_pinned_adapter_keeps_its_slot(spare_model, lora_adapters, prompts) -> None:
    model, config = spare_model
    manager = LoraManager(model, max_loras=2, max_lora_rank=64)
    manager.load("sql", str(lora_adapters["sql"]), pinned=True)
    for name in ("pirate", "wizard"):
        manager.load(name, str(lora_adapters[name]))
    with pytest.raises(LoraError, match="cannot be pinned"):  # one slot stays unpinned
        manager.load("pirate", str(lora_adapters["pirate"]), pinned=True)
    pinned = manager.slots.find(manager.get("sql").key)
    jobs = [(prompts[0], name) for name in ["pirate", "wizard", "sql", "pirate", "wizard"]]
    generate((model, config, manager), jobs)
    assert manager.slots.find(manager.get("sql").key) == pinned
    assert manager.slots.num_evictions >= 1  # the other slot changed hands


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapters_are_refused_by_name(engine, lora_adapters, tmp_path) -> None:
    _, _, manager = engine
    sql = lora_adapters["sql"]
    missing = _copy(sql, tmp_path / "missing")
    (missing / "adapter_model.safetensors").unlink()
    wide = _copy(sql, tmp_path / "wide")  # trained for a model of hidden size 640
    tensors = load_file(wide / "adapter_model.safetensors")
    for key, t in tensors.items():
        if ".q_proj.lora_A" in key:
            tensors[key] = torch.zeros(t.shape[0], 640)
    save_file(tensors, wide / "adapter_model.safetensors")
    head = _copy(sql, tmp_path / "head")
    tensors = load_file(head / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 576)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(49152, 8)
    save_file(tensors, head / "adapter_model.safetensors")
    dora = _copy(sql, tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    cases = {
        tmp_path / "nowhere": "does not exist",
        missing: "adapter_model.safetensors not found",
        wide: "640",
        head: "lm_head",
        dora: "use_dora",
    }
    for path, words in cases.items():
        with pytest.raises(LoraError, match=words):
            manager.read("bad", str(path))
    with pytest.raises(LoraError, match="rank 8 of module .* exceeds --max-lora-rank 4"):
        read_adapter(sql, max_rank=4)
