"""Load a model: a Hugging Face safetensors folder, a GGUF file, or a folder made for one
(``engine.model.gguf.folder``), into the family's model class (``engine.model.registry``).

Every source yields checkpoint tensors under their HF names; the family's ``weight_map`` says
which parameter slice each fills. Tensors are converted to the serving dtype while copying.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.config import EngineConfig
from splitserve.engine.attention.base import (
    BaseAttentionBackend,
    create_attention_backend,
    default_attention_backend,
)
from splitserve.engine.model.base import DecoderLM
from splitserve.engine.model.compressed import dequantized, read_quantization
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.gguf.config import hf_config
from splitserve.engine.model.gguf.reader import GGUFFile, open_gguf
from splitserve.engine.model.gguf.tensors import iter_tensors
from splitserve.engine.model.kernel_plan import choose_product_plan
from splitserve.engine.model.registry import get_architecture
from splitserve.engine.model.weight_digest import WeightDigest

INDEX_FILE = "model.safetensors.index.json"
# (HF name, a description for errors, load the tensor)
Tensors = Iterator[tuple[str, str, Callable[[], torch.Tensor]]]


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


def gguf_in_folder(path: Path) -> Path | None:
    """The folder's GGUF weights file (``*.gguf``), or None; a folder with several is refused.

    Raises:
        ValueError: more than one ``*.gguf`` file.
    """
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"model folder {path} holds several GGUF files: {[f.name for f in found]}")
    return found[0] if found else None


def read_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a model folder or a ``.gguf`` file (from its metadata).

    Raises:
        FileNotFoundError: nothing at ``path``, or a folder without ``config.json``.
        ValueError: an unsupported architecture or feature, or a bad GGUF file (``GGUFError``).
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return ModelConfig.from_hf(hf_config(open_gguf(path)))
    return ModelConfig.from_dir(path)


def _safetensors(files: list[Path]) -> Tensors:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f"{file.name}: tensor {name}", lambda f=f, name=name: f.get_tensor(name)


def _gguf(gguf: GGUFFile, config: ModelConfig) -> Tensors:
    for t in iter_tensors(gguf, config.num_heads, config.num_kv_heads):
        where = f"{gguf.path.name}: tensor {t.gguf_name} ({t.tensor_type}, as {t.hf_name})"
        yield t.hf_name, where, t.load


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_backend: BaseAttentionBackend | None = None,
    engine: EngineConfig | None = None,
) -> tuple[DecoderLM, ModelConfig]:
    """Build the model for ``path`` and fill it from its weights.

    Args:
        path: a folder with ``config.json`` and ``*.safetensors`` (single file or sharded +
            index; float, or compressed-tensors ``pack-quantized``, ``engine.model.compressed``)
            or one ``*.gguf`` weights file, or a ``.gguf`` file itself (config from its
            metadata).
        dtype: serving dtype (weights are converted, GGUF ones de-quantized, while copying).
        device: where parameters live.
        attn_backend: attention implementation; default ``engine.attention`` (``auto``: Triton
            on CUDA, torch elsewhere).
        engine: the switches it reads: ``attention``, ``cpu_kernels``, ``decode_kv_cache``,
            ``pack_weights``, ``fused_decode``, ``quantization`` (default: ``EngineConfig()``'s).

    Returns:
        ``(model, config)``; the model is in eval mode, its ``weights_digest`` set
        (``engine.model.weight_digest``: the checkpoint's values as loaded, before
        ``quantization``).

    Raises:
        FileNotFoundError: folder, ``config.json`` or a weights file missing.
        ValueError: unsupported architecture, a bad GGUF file (``GGUFError``, naming the file
            and the cause), or a tensor the model needs is missing or misshapen.
    """
    path = Path(path)
    gguf_file = path if path.is_file() and path.suffix == ".gguf" else None
    if gguf_file is None and path.is_dir():
        gguf_file = gguf_in_folder(path)
    config = read_config(path)
    engine = engine or EngineConfig()
    model_cls = get_architecture(config.architecture).model_class()
    wanted = model_cls.weight_map(config)
    exact_params: set[str] = set()
    if gguf_file is not None:
        gguf = open_gguf(gguf_file)
        tensors, source = _gguf(gguf, config), str(gguf_file)
        if engine.quantization == "int4":
            exact_params = q4_0_params(gguf, config, wanted)
    else:
        tensors, source = _safetensors(weight_files(path)), f"model folder {path}"
        config_file = path / "config.json"
        scheme = read_quantization(json.loads(config_file.read_text()), str(config_file))
        if scheme is not None:  # compressed-tensors: de-quantized here, served as float
            tensors = dequantized(tensors, scheme)
    if attn_backend is None:
        name = default_attention_backend(device, engine.attention)
        options = {"use_decode_cache": engine.decode_kv_cache,
                   "use_cpu_kernels": engine.cpu_kernels} if name == "torch" else {}
        attn_backend = create_attention_backend(name, **options)
    with torch.device(device):
        model = model_cls(config, dtype, attn_backend, fused_decode=engine.fused_decode)
    for table in model.rotary_tables():
        table.to(device)
    digest = WeightDigest()
    exact = _fill(model, wanted, digest.watch(tensors), source, exact_params)
    model.weights_digest = digest.hexdigest()
    # Before packing: the packs read the weights.
    model.quantize_weights(engine.quantization, exact)
    del exact
    if engine.pack_weights:  # CPU bfloat16: oneDNN-packed projections (no-op elsewhere)
        model.pack_weights(engine.cpu_kernels)
    if model.kernels is not None and model.head.packed is not None:
        # Both C and oneDNN copies exist: which one serves each step size is measured here.
        model.set_product_plan(
            choose_product_plan(model, engine.kernels, model.kernels.decode_max_rows)
        )
    return model.eval(), config


def q4_0_params(gguf: GGUFFile, config: ModelConfig, wanted: dict) -> set[str]:
    """Our parameters that take a Q4_0 tensor of ``gguf`` (in any of their slices): int4
    quantizes those from their float32 values, in which Q4_0 de-quantizes exactly, so they keep
    the file's levels and scales (``engine.model.quant_int4``, on Q4_0's symmetric grid; the
    other rows of a fused parameter, e.g. a Q6_K ``v_proj`` beside Q4_0 ``q``/``k``, take that
    grid too); a bfloat16 copy would round them. Reads no tensor data."""
    return {wanted[t.hf_name][0] for t in iter_tensors(gguf, config.num_heads, config.num_kv_heads)
            if t.tensor_type == "Q4_0" and t.hf_name in wanted}


def _fill(model: DecoderLM, wanted: dict, tensors: Tensors, source: str,
          exact_params: set[str] = frozenset()) -> dict[str, torch.Tensor]:  # type: ignore[assignment]
    """Copy every wanted tensor into its parameter slice; returns, for each parameter of
    ``exact_params``, its full value in float32 as loaded (before the serving dtype rounds it).

    Raises:
        ValueError: a tensor of the wrong shape, wanted tensors absent from ``source``, or
            weights in ``source`` that no parameter takes.
    """
    params = dict(model.named_parameters())
    exact: dict[str, torch.Tensor] = {}
    filled: set[str] = set()
    unused: list[str] = []
    for name, where, load in tensors:
        if name not in wanted:
            # A weight or bias we have no place for is a feature we do not implement: refuse
            # rather than serve without it. (A tied lm_head.weight, or a buffer such as rotary
            # inv_freq, is fine to skip.)
            if name.endswith((".weight", ".bias")) and not (
                name == "lm_head.weight" and model.lm_head is None
            ):
                unused.append(where)
            continue
        ours, index = wanted[name]
        target = params[ours].data[index]
        tensor = load()
        if tensor.shape != target.shape:
            raise ValueError(
                f"{where} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        if ours in exact_params:
            if ours not in exact:
                exact[ours] = torch.zeros(params[ours].shape, dtype=torch.float32)
            exact[ours][index] = tensor.float()
        filled.add(name)
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise ValueError(
            f"{source} holds weights this architecture's model has no place for (a feature "
            f"not implemented): {'; '.join(unused[:3])}{more}"
        )
    missing = sorted(set(wanted) - filled)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{source} lacks tensors: {', '.join(missing[:5])}{more}")
    return exact
