"""compressed-tensors W4A16 / W8A16 checkpoints de-quantized at load (``engine.model.compressed``)
against the ``compressed-tensors`` package's own compression and decompression (skipped where
that package is not installed: it is a test-only reference)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splitserve.engine.model.compressed import PackScheme, dequantize_packed
from tests.engine.test_compressed_tensors import _config

pytest.importorskip("compressed_tensors", reason="the compressed-tensors reference")
from compressed_tensors import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)


def _scheme(num_bits: int, strategy: str, group_size: int | None, symmetric: bool):
    args = QuantizationArgs(
        num_bits=num_bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def _compress(w: torch.Tensor, scheme, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The package's compression of ``w`` with absmax scales (random zero points when
    asymmetric)."""
    args = scheme.weights
    groups = 1 if args.strategy == "channel" else w.shape[1] // args.group_size
    top = (1 << (args.num_bits - 1)) - 1
    absmax = w.reshape(w.shape[0], groups, -1).abs().amax(-1)
    state = {"weight": w, "weight_scale": (absmax / top).clamp_min(1e-8)}
    if not args.symmetric:
        state["weight_zero_point"] = torch.randint(
            -2, 3, (w.shape[0], groups), generator=gen, dtype=torch.int8
        )
    return PackedQuantizationCompressor.compress(state, scheme)


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize(("strategy", "group_size"), [("channel", None), ("group", 32)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_equals_the_package(num_bits, strategy, group_size, symmetric) -> None:
    gen = torch.Generator().manual_seed(num_bits + 2 * symmetric)
    scheme = _scheme(num_bits, strategy, group_size, symmetric)
    for shape in ((48, 96), (40, 72) if strategy == "channel" else (40, 96)):  # 72: a part word
        compressed = _compress(torch.randn(*shape, generator=gen), scheme, gen)
        reference = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]
        ours = dequantize_packed(compressed, PackScheme(num_bits, strategy, group_size, symmetric))
        assert ours.dtype == torch.float32 and ours.shape == shape
        torch.testing.assert_close(ours, reference.float(), rtol=0, atol=0)


def test_w4a16_checkpoint_loads_as_the_package_decompresses(model_path, tmp_path) -> None:
    """The default model's projections as W4A16 (groups of 64, symmetric): the loaded model's
    parameters equal those of a float checkpoint of the package's decompression."""
    from splitserve.engine.model.loader import load_model

    scheme = _scheme(4, "group", 64, True)
    gen = torch.Generator().manual_seed(0)
    compressed, decompressed = {}, {}
    with safe_open(str(model_path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensor = f.get_tensor(name)
            if not name.endswith("proj.weight"):
                compressed[name] = decompressed[name] = tensor
                continue
            parts = _compress(tensor.float(), scheme, gen)
            prefix = name.removesuffix(".weight")
            compressed |= {f"{prefix}.{k}": v for k, v in parts.items()}
            decompressed[name] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
    config = json.loads((model_path / "config.json").read_text())
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    for folder, tensors, extra in (
        (tmp_path / "w4a16", compressed, {"quantization_config": qc.model_dump(mode="json")}),
        (tmp_path / "float", decompressed, {}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config | extra))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors")
        )
    quantized, _ = load_model(tmp_path / "w4a16", torch.float32)
    reference, _ = load_model(tmp_path / "float", torch.float32)
    ref_params = dict(reference.named_parameters())
    for name, param in quantized.named_parameters():
        assert torch.equal(param, ref_params[name]), name
    plain_model = load_model(model_path, torch.float32)[0]
    plain = dict(plain_model.named_parameters())
    changed = [n for n, p in quantized.named_parameters() if not torch.equal(p, plain[n])]
    assert changed and all("proj" in n for n in changed)  # 4-bit levels, not the float weights
    # The weights digest is of the values as loaded: the de-quantized ones.
    assert quantized.weights_digest == reference.weights_digest != plain_model.weights_digest


def test_layer_missing_its_scale_is_refused(model_path, tmp_path) -> None:
    from splitserve.engine.model.loader import load_model

    scheme = _scheme(4, "group", 64, True)
    with safe_open(str(model_path / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    name = "model.layers.0.mlp.down_proj"
    parts = _compress(tensors.pop(f"{name}.weight").float(), scheme, torch.Generator())
    del parts["weight_scale"]
    tensors |= {f"{name}.{k}": v for k, v in parts.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((model_path / "config.json").read_text()) | _config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"layer {name} lacks weight_scale"):
        load_model(tmp_path, torch.float32)
