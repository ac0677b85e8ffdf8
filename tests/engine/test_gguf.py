"""GGUF files as models: tiny random models written as GGUF (llama.cpp's layout, several tensor
types) load with logits equal to transformers loading the same file (float32); bad files are
refused with the file and the cause, by the loader and at launch by the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.model.gguf.folder import resolve_gguf
from splitserve.engine.model.gguf.reader import GGUFError, open_gguf
from splitserve.engine.model.loader import load_model
from tests.engine.gguf_files import write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
COMMON = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "initializer_range": 0.2, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
# name: (HF config class, GGUF architecture, extra config, weight type, embedding type).
# transformers' GGUF reader does not read every size from the metadata (Qwen3's head_dim,
# Qwen3-MoE's expert width, Gemma 3's query scale), so those take its defaults here.
CASES = {
    "llama_q8_0": ("LlamaConfig", "llama", {}, "Q8_0", None),
    "qwen2_q5_0_tied": ("Qwen2Config", "qwen2", {"tie_word_embeddings": True}, "Q5_0", "Q8_0"),
    "qwen3_q4_0": ("Qwen3Config", "qwen3", {"head_dim": 128}, "Q4_0", "F16"),
    "qwen3_moe_q8_0": ("Qwen3MoeConfig", "qwen3moe", {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 768, "norm_topk_prob": True}, "Q8_0", None),
    "gemma3_bf16": ("Gemma3TextConfig", "gemma3", {
        "head_dim": 256, "num_hidden_layers": 6, "sliding_window": 5,
        "tie_word_embeddings": True}, "BF16", "Q8_0"),
    "phi3_f16": ("Phi3Config", "phi3", {}, "F16", "F32"),
}


def _tiny_gguf(name: str, tmp: Path, seed: int = 0) -> Path:
    import transformers

    cls, arch, extra, qtype, embed = CASES[name]
    torch.manual_seed(seed)
    hf_cfg = {**COMMON, **extra}
    if cls == "Gemma3TextConfig":
        hf_cfg["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
        hf_cfg["rope_theta"] = 1e6
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**hf_cfg))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if pname.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(tmp / "hf")
    return write_gguf(tmp / "hf", tmp / f"{name}.gguf", arch, hf_cfg, qtype, embed)


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_gguf(request, tmp_path_factory) -> Path:
    return _tiny_gguf(request.param, tmp_path_factory.mktemp(request.param))


def _logits(model, cfg, ids: list[int], split: int) -> torch.Tensor:
    """Our logits at every position: a prefill of ``ids[:split]``, then one decode step per
    token (pages 4 tokens long)."""
    pool = KVPool(cfg.kv_layout(4, "float32"), 16, "cpu")
    pages = pool.allocator.alloc(8)
    b = build_forward_batch([ids[:split]], [0], [pages], 4, [0])
    b.logit_indices = torch.arange(split)
    out = [model(b, pool)]
    for pos in range(split, len(ids)):
        out.append(model(build_forward_batch([[ids[pos]]], [pos], [pages], 4, [0]), pool))
    return torch.cat(out)


def test_gguf_logits_equal_transformers(tiny_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, cfg = load_model(tiny_gguf, torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.randint(3, 96, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(model, cfg, ids, 9), ref, atol=ATOL, rtol=0)


def test_gguf_records_tensor_types(tiny_gguf: Path) -> None:
    """The loader keeps each tensor's GGML type known (for a later kernel that keeps it)."""
    kind = next(c for n, c in CASES.items() if tiny_gguf.stem == n)[3]
    types = open_gguf(tiny_gguf).tensor_types
    assert types["blk.0.attn_output.weight"] == kind
    assert types["output_norm.weight"] == "F32"


def test_weights_digest_of_gguf_files(tmp_path: Path) -> None:
    """The KV handshake's weights digest (``engine.model.weight_digest``) of a GGUF file: one
    on every load of it (two workers), the same under ``--quantization`` (taken before it), and
    another for a file of the same config whose values differ."""
    from splitserve.config import EngineConfig
    from splitserve.engine.model.loader import read_config

    one = _tiny_gguf("llama_q8_0", tmp_path / "one")
    other = _tiny_gguf("llama_q8_0", tmp_path / "other", seed=1)
    assert read_config(one).fingerprint() == read_config(other).fingerprint()
    digest = load_model(one, torch.float32)[0].weights_digest
    assert load_model(one, torch.float32)[0].weights_digest == digest
    int8 = load_model(one, torch.float32, engine=EngineConfig(quantization="int8"))[0]
    assert int8.weights_digest == digest
    assert load_model(other, torch.float32)[0].weights_digest != digest


# --- bad files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> Path:
    return _tiny_gguf("llama_q8_0", tmp_path_factory.mktemp("good"))


def _with_tensor_type(src: Path, dst: Path, type_name: str) -> Path:
    """A copy of ``src`` with one weight's type replaced by ``type_name`` (same byte size)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    qt = gguf.GGMLQuantizationType[type_name]
    for t in reader.tensors:
        if t.name == "blk.0.ffn_down.weight":
            block, size = gguf.GGML_QUANT_SIZES[qt]
            row_len, rows = (int(d) for d in t.shape)  # GGUF lists the innermost first
            raw = np.zeros((rows, row_len // block * size), dtype=np.uint8)  # byte shape
            w.add_tensor(t.name, raw, raw_dtype=qt)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _truncated(good: Path, dst: Path) -> Path:
    dst.write_bytes(good.read_bytes()[:-64])  # the last tensor's data runs past the end
    return dst


def _header_cut(good: Path, dst: Path) -> Path:
    dst.write_bytes(good.read_bytes()[:200])  # inside the metadata
    return dst


def _other_architecture(good: Path, dst: Path) -> Path:
    # "llama" -> "mamba" in general.architecture: same length, so every offset stays valid.
    length = len(b"llama").to_bytes(8, "little")
    dst.write_bytes(good.read_bytes().replace(length + b"llama", length + b"mamba", 1))
    return dst


def _not_gguf(good: Path, dst: Path) -> Path:
    dst.write_bytes(b"PK\x03\x04 not a gguf")
    return dst


# kind: (make the bad file from a good one, the error it must give after "<path>: ")
BAD_FILES = {
    "truncated": (_truncated, r"unreadable GGUF file, truncated"),
    "header_cut": (_header_cut, r"unreadable GGUF file, truncated"),
    "not_gguf": (_not_gguf, r"not a GGUF file"),
    "architecture": (_other_architecture, r"unsupported GGUF architecture 'mamba'"),
    "tensor_type": (
        lambda good, dst: _with_tensor_type(good, dst, "IQ4_NL"),
        r"unsupported tensor type IQ4_NL \(e\.g\. blk\.0\.ffn_down\.weight\)",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_refused_by_loader(kind: str, good_gguf: Path, tmp_path: Path) -> None:
    make, cause = BAD_FILES[kind]
    bad = make(good_gguf, tmp_path / f"{kind}.gguf")
    with pytest.raises(GGUFError, match=rf"^{re.escape(str(bad))}: {cause}"):
        load_model(bad)


@pytest.mark.parametrize(
    ("kind", "command"),
    [("truncated", "serve"), ("architecture", "serve"), ("tensor_type", "launch")],
)
def test_launch_refuses_a_bad_gguf(
    kind: str, command: str, good_gguf: Path, tmp_path: Path
) -> None:
    """``splitserve serve|launch --model bad.gguf`` exits at once, before starting any worker,
    with one line naming the file and the cause."""
    make, cause = BAD_FILES[kind]
    bad = make(good_gguf, tmp_path / f"{kind}.gguf")
    env = {"SPLITSERVE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "splitserve", command, "--model", str(bad), "--port", "0"],
        check=False, capture_output=True, text=True, timeout=120, env=env,
    )
    assert run.returncode != 0
    assert re.search(rf"error: {re.escape(str(bad))}: {cause}", run.stderr), run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_gguf_folder(good_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    """A ``.gguf`` resolves to a folder (config from metadata, weights linked) that loads to the
    same model, and is made once."""
    pytest.importorskip("transformers")
    calls = []
    import transformers

    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(a) or _NoTokenizer())
    folder = resolve_gguf(good_gguf, tmp_path)
    assert resolve_gguf(good_gguf, tmp_path) == folder and len(calls) == 1
    assert folder.name == good_gguf.stem and (folder / "model.gguf").resolve() == good_gguf
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", real)
    a, _ = load_model(good_gguf)
    b, _ = load_model(folder)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


class _NoTokenizer:
    """Stands in for the tokenizer (the tiny files carry no vocabulary)."""

    chat_template = "{{ messages }}"

    def save_pretrained(self, folder: Path) -> None:
        (Path(folder) / "tokenizer_config.json").write_text("{}")
