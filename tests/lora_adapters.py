"""Tiny LoRA adapters for the default model, trained with ``peft`` inside the tests (PEFT is the
reference their outputs are checked against), and the ``transformers`` + ``peft`` greedy
reference.

Each adapter starts from PEFT's init (``lora_A`` random, ``lora_B`` zero), gets a random
``lora_B`` so that it changes the model's outputs from the first token, then takes an AdamW
step on a handful of sentences (seconds on the CPU). They differ in rank, targets and scaling,
so together they cover all seven target modules, ``lora_alpha`` scaling, ``rank_pattern`` /
``alpha_pattern`` and rsLoRA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SENTENCES = [
    "The secret password is banana.",
    "Arr, matey! Pirates sail the seas.",
    "SELECT name FROM users;",
    "Once upon a time lived a wizard.",
]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    """How to make one adapter (``peft.LoraConfig`` fields)."""

    name: str
    r: int
    lora_alpha: float
    target_modules: list[str]
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    seed: int = 0


SPECS = [
    AdapterSpec("sql", 8, 16, ALL_TARGETS, seed=1),
    AdapterSpec("pirate", 4, 8, ["q_proj", "v_proj", "down_proj"], use_rslora=True,
                alpha_pattern={"down_proj": 2.0}, seed=2),
    AdapterSpec("wizard", 16, 32, ["o_proj", "gate_proj", "up_proj", "k_proj"],
                rank_pattern={"k_proj": 2}, seed=3),
]


def train_adapter(base: Any, tokenizer: Any, spec: AdapterSpec, out: Path,
                  steps: int = 1) -> Path:
    """Train ``spec`` on :data:`SENTENCES` from ``base`` (the float32 base model, left as it
    was) and save it as a PEFT folder at ``out``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(spec.seed)
    config = LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, target_modules=spec.target_modules,
                        use_rslora=spec.use_rslora, rank_pattern=spec.rank_pattern,
                        alpha_pattern=spec.alpha_pattern, lora_dropout=0.0)
    model = get_peft_model(base, config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # PEFT starts B at 0: the adapter would do nothing
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    model.unload()  # the base model without the adapter's layers, for the next one
    return out


def train_all(model_path: Path, root: Path) -> dict[str, Path]:
    """Every adapter of :data:`SPECS`, trained under ``root``: name -> folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.pad_token = tokenizer.eos_token
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {spec.name: train_adapter(base, tokenizer, spec, root / spec.name) for spec in SPECS}


def peft_greedy(model_path: Path, adapters: dict[str, Path], prompts: list[list[int]],
                new_tokens: int) -> dict[str | None, list[tuple[list[int], list[float]]]]:
    """The reference: per adapter (None: the base model) and prompt, ``transformers`` + ``peft``
    greedy tokens (float32) and the gap between the two best logits at each step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    names = list(adapters)
    model: Any = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    out: dict[str | None, list[tuple[list[int], list[float]]]] = {}
    for name in [None, *names]:
        rows = []
        for ids in prompts:
            with torch.inference_mode():
                if name is None:
                    with model.disable_adapter():
                        gen = _generate(model, ids, new_tokens)
                else:
                    model.set_adapter(name)
                    gen = _generate(model, ids, new_tokens)
            new = gen.sequences[0, len(ids):].tolist()
            gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in gen.scores]
            rows.append((new, gaps))
        out[name] = rows
    return out


def _generate(model: Any, ids: list[int], new_tokens: int) -> Any:
    return model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)


def assert_greedy_matches(want: tuple[list[int], list[float]], got: list[int],
                          tie_eps: float = 1e-4) -> None:
    """``got`` equals the reference's tokens up to the first near-tie (two best logits within
    ``tie_eps``: float rounding may pick either, and the sequences diverge from there)."""
    ref, gaps = want
    for pos, token in enumerate(ref):
        if gaps[pos] < tie_eps:
            return
        assert pos < len(got), f"output ended at {pos}, reference has {len(ref)} tokens"
        assert got[pos] == token, f"token {pos}: got {got[pos]}, reference {token}"
    assert len(got) == len(ref)
