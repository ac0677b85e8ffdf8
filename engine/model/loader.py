"""Load a Hugging Face safetensors model folder into :class:`LlamaForCausalLM`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.config import EngineConfig
from splitserve.engine.attention.base import (
    BaseAttentionBackend,
    create_attention_backend,
    default_attention_backend,
)
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.kernel_plan import choose_product_plan
from splitserve.engine.model.llama import LlamaForCausalLM, hf_weight_map

INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The folder's safetensors files: those named by the shard index if there is one, else all.

    Raises:
        FileNotFoundError: no safetensors file, or a shard the index names is missing.
    """
    index = path / INDEX_FILE
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        for f in files:
            if not f.exists():
                raise FileNotFoundError(
                    f"weights shard {f.name} (named in {INDEX_FILE}) not found in {path}"
                )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights file in model folder {path}")
    return files


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_backend: BaseAttentionBackend | None = None,
    engine: EngineConfig | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for ``path`` and fill it from its safetensors weights.

    Args:
        path: folder with ``config.json`` and ``*.safetensors`` (single file or sharded + index).
        dtype: serving dtype (weights are converted while copying).
        device: where parameters live.
        attn_backend: attention implementation; default ``engine.attention`` (``auto``: Triton
            on CUDA, torch elsewhere).
        engine: the switches it reads: ``attention``, ``cpu_kernels``, ``decode_kv_cache``,
            ``pack_weights``, ``fused_decode``, ``quantization`` (default: ``EngineConfig()``'s).

    Returns:
        ``(model, config)``; the model is in eval mode.

    Raises:
        FileNotFoundError: folder, ``config.json`` or a weights file missing.
        ValueError: unsupported architecture, or a tensor the model needs is missing or misshapen.
    """
    path = Path(path)
    config = ModelConfig.from_dir(path)
    files = weight_files(path)
    engine = engine or EngineConfig()
    if attn_backend is None:
        name = default_attention_backend(device, engine.attention)
        options = {"use_decode_cache": engine.decode_kv_cache,
                   "use_cpu_kernels": engine.cpu_kernels} if name == "torch" else {}
        attn_backend = create_attention_backend(name, **options)
    with torch.device(device):
        model = LlamaForCausalLM(config, dtype, attn_backend, fused_decode=engine.fused_decode)
    model.rope.to(device)
    params = dict(model.named_parameters())
    wanted = hf_weight_map(config)
    filled: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name not in wanted:
                    continue  # e.g. a tied lm_head.weight, rotary inv_freq buffers
                ours, row, rows = wanted[name]
                tensor = f.get_tensor(name)
                target = params[ours].data[row : row + rows]
                if tensor.shape != target.shape:
                    raise ValueError(
                        f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                filled.add(name)
    missing = sorted(set(wanted) - filled)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"model folder {path} lacks tensors: {', '.join(missing[:5])}{more}")
    model.quantize_weights(engine.quantization)  # before packing: the packs read the weights
    if engine.pack_weights:  # CPU bfloat16: oneDNN-packed projections (no-op elsewhere)
        model.pack_weights(engine.cpu_kernels)
    if model.kernels is not None and model.head.packed is not None:
        # Both C and oneDNN copies exist: which one serves each step size is measured here.
        model.set_product_plan(
            choose_product_plan(model, engine.kernels, model.kernels.decode_max_rows)
        )
    return model.eval(), config
