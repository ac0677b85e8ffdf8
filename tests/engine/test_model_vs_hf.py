"""Our paged models against transformers on tiny random models (float32): the Llama family
(Llama, Qwen2, Mistral) and Qwen3, Qwen3-MoE (3 of 8 experts per token, a dense layer too),
Gemma 3 (a windowed and a global layer, their own RoPE bases, logit soft-capping) and Phi-3
(LongRoPE), each through prefill, prefill over a cached prefix, decode and a mixed batch.

Our model runs on ``$SPLITSERVE_DEVICE`` (default cpu; on cuda the loader picks the Triton
attention backend); transformers stays on CPU.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine.forward_batch import ForwardBatch, build_forward_batch
from splitserve.engine.kv_pool import KVPool, pages_for
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = os.environ.get("SPLITSERVE_DEVICE", "cpu")
PAGE_SIZE = 4
ATOL = 1e-4
COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama_bias_llama3": ("LlamaConfig", {"attention_bias": True, "rope_parameters": LLAMA3}),
    "llama_linear": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}},
    ),
    "qwen2_yarn": (
        "Qwen2Config",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "mistral_window": ("MistralConfig", {"sliding_window": 6}),
    "qwen3": ("Qwen3Config", {"head_dim": 24, "attention_bias": True}),
    # Layer 0 global, layer 1 windowed: per-layer windows outside Gemma too.
    "qwen3_window": ("Qwen3Config", {"use_sliding_window": True, "sliding_window": 5,
                                     "max_window_layers": 1}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 3,
                                     "moe_intermediate_size": 40, "norm_topk_prob": True,
                                     "mlp_only_layers": [1], "head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 32, "query_pre_attn_scalar": 20, "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 8.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }),
    # LongRoPE within the original context (the factors and the attention factor apply);
    # crossing it is test_longrope_decode_past_original_context.
    "phi3_longrope": ("Phi3Config", {
        "pad_token_id": 0, "eos_token_id": 1, "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)],
    }}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    """``(our model, config, HF model)`` for one tiny random architecture."""
    import transformers

    cls_name, extra = CASES[request.param]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: randomize so mapping bugs show
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # the router: spread its choices
                p.copy_(torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, cfg = load_model(path, torch.float32, DEVICE)
    return model, cfg, hf.eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` float32 reference logits for every position."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


class Runner:
    """Drives our model directly: one pool, pages handed out in shuffled (non-contiguous) order."""

    def __init__(self, model, cfg: ModelConfig) -> None:
        self.model = model
        self.pool = KVPool(cfg.kv_layout(PAGE_SIZE, "float32"), 64, DEVICE)
        self.spare = self.pool.allocator.alloc(60)
        random.Random(0).shuffle(self.spare)

    def pages(self, num_tokens: int) -> list[int]:
        n = pages_for(num_tokens, PAGE_SIZE)
        out, self.spare = self.spare[:n], self.spare[n:]
        return out

    def step(
        self,
        chunks: list[list[int]],
        prefix_lens: list[int],
        pages: list[list[int]],
        all_logits: bool = False,
    ) -> torch.Tensor:
        rows = list(range(len(chunks)))
        batch = build_forward_batch(chunks, prefix_lens, pages, PAGE_SIZE, rows, DEVICE)
        if all_logits:
            batch = _score_all(batch)
        return self.model(batch, self.pool).cpu()


def _score_all(batch: ForwardBatch) -> ForwardBatch:
    batch.logit_indices = torch.arange(batch.input_ids.numel(), device=batch.input_ids.device)
    return batch


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prefill(tiny) -> None:
    model, cfg, hf = tiny
    ids = tokens(13, 1)
    run = Runner(model, cfg)
    ours = run.step([ids], [0], [run.pages(13)], all_logits=True)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_prefill_over_cached_prefix(tiny) -> None:
    model, cfg, hf = tiny
    ids = tokens(15, 2)
    run = Runner(model, cfg)
    pages = run.pages(15)
    run.step([ids[:7]], [0], [pages[:2]])
    ours = run.step([ids[7:]], [7], [pages], all_logits=True)
    torch.testing.assert_close(ours, hf_logits(hf, ids)[7:], atol=ATOL, rtol=0)


def test_decode_steps(tiny) -> None:
    model, cfg, hf = tiny
    ids = tokens(18, 3)
    ref = hf_logits(hf, ids)
    run = Runner(model, cfg)
    pages = run.pages(18)
    first = run.step([ids[:11]], [0], [pages])
    torch.testing.assert_close(first[0], ref[10], atol=ATOL, rtol=0)
    for pos in range(11, 18):
        out = run.step([[ids[pos]]], [pos], [pages])
        torch.testing.assert_close(out[0], ref[pos], atol=ATOL, rtol=0)


def test_mixed_batch_equals_each_alone(tiny) -> None:
    model, cfg, hf = tiny
    seqs = [tokens(n, 10 + n) for n in (11, 9, 10, 3, 14)]
    refs = [hf_logits(hf, s) for s in seqs]
    # Each sequence: (tokens already cached, tokens run in the mixed step).
    plan = [(0, 11), (5, 4), (9, 1), (2, 1), (13, 1)]
    run = Runner(model, cfg)
    pages = [run.pages(len(s) + 1) for s in seqs]
    for s, p, (cached, _) in zip(seqs, pages, plan, strict=True):
        if cached:
            run.step([s[:cached]], [0], [p])
    chunks = [s[c : c + n] for s, (c, n) in zip(seqs, plan, strict=True)]
    out = run.step(chunks, [c for c, _ in plan], pages)
    for i, (s, ref) in enumerate(zip(seqs, refs, strict=True)):
        torch.testing.assert_close(out[i], ref[len(s) - 1], atol=ATOL, rtol=0)
    # Then one decode-only step over all of them (ragged lengths, batched gather and mask).
    nxt = [tokens(1, 100 + i)[0] for i in range(len(seqs))]
    out = run.step([[t] for t in nxt], [len(s) for s in seqs], pages)
    for i, (s, t) in enumerate(zip(seqs, nxt, strict=True)):
        torch.testing.assert_close(out[i], hf_logits(hf, s + [t])[-1], atol=ATOL, rtol=0)


def test_return_hidden(tiny) -> None:
    model, cfg, _ = tiny
    run = Runner(model, cfg)
    batch = build_forward_batch([tokens(5, 4)], [0], [run.pages(5)], PAGE_SIZE, [0], DEVICE)
    logits, hidden = model(batch, run.pool, return_hidden=True)
    assert logits.shape == (1, cfg.vocab_size) and logits.dtype == torch.float32
    assert hidden.shape == (1, cfg.hidden_size)


# --- config parsing and loader errors ------------------------------------------------------


def test_config_rope_forms() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "eos_token_id": [2, 3],
    }
    legacy = ModelConfig.from_hf(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new = ModelConfig.from_hf(
        {**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}},
        {"eos_token_id": [3, 7]},
    )
    for c in (legacy, new):
        assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
        assert c.num_kv_heads == 2 and c.head_dim == 4
    assert new.eos_token_ids == [2, 3, 7]
    plain = ModelConfig.from_hf(
        {**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}
    )
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_unsupported_architecture(tiny, tmp_path: Path) -> None:
    _model, _cfg, hf = tiny
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path)


def test_loader_missing_files(tiny, tmp_path: Path) -> None:
    _, _, hf = tiny
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    hf.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    gone = max(k for k in tensors if k.startswith("model.layers.1.self_attn."))
    del tensors[gone]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(gone)):
        load_model(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_sharded_checkpoint(tiny, tmp_path: Path) -> None:
    model, _cfg, hf = tiny
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    sharded, _ = load_model(tmp_path, device=DEVICE)
    for (name, a), (_, b) in zip(model.named_parameters(), sharded.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_longrope_decode_past_original_context(tmp_path: Path) -> None:
    """Phi-3 LongRoPE across ``original_max_position_embeddings`` (16): a prompt inside it, then
    decode steps past it, against transformers decoding with its KV cache (each step's token
    rotated with the long factors once its position reaches 16, as ours are)."""
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.Phi3Config(**{**COMMON, **CASES["phi3_longrope"][1],
                                        "original_max_position_embeddings": 16})
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path, torch.float32, DEVICE)
    ids = tokens(24, 7)
    run = Runner(model, cfg)
    pages = run.pages(24)
    with torch.no_grad():
        out = hf(torch.tensor([ids[:12]]), use_cache=True)
        torch.testing.assert_close(run.step([ids[:12]], [0], [pages])[0], out.logits[0, -1],
                                   atol=ATOL, rtol=0)
        past = out.past_key_values
        for pos in range(12, 24):
            out = hf(torch.tensor([[ids[pos]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            ours = run.step([[ids[pos]]], [pos], [pages])[0]
            torch.testing.assert_close(ours, out.logits[0, -1], atol=ATOL, rtol=0)
