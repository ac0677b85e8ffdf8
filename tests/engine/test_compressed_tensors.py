"""compressed-tensors ``pack-quantized`` checkpoints (W4A16 / W8A16): every variant we do not
serve is refused at launch naming ``config.json`` and the cause (the de-quantization itself:
``test_compressed_tensors_reference.py``)."""

from __future__ import annotations

import json

import pytest

from splitserve.engine.model.compressed import PackScheme, read_quantization
from splitserve.engine.model.config import ModelConfig


def _group(num_bits=4, strategy="group", group_size=64, symmetric=True, **extra) -> dict:
    weights = {
        "num_bits": num_bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": strategy,
        "group_size": group_size,
        "dynamic": False,
    }
    return {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": None,
        **extra,
    }


def _config(**qc) -> dict:
    base = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "ignore": ["lm_head"],
        "config_groups": {"group_0": _group()},
    }
    return {"quantization_config": {**base, **qc}}


@pytest.mark.parametrize(
    ("qc", "cause"),
    [
        (
            {"config_groups": {"g": _group(input_activations={"num_bits": 8, "type": "int"})}},
            "input_activations are quantized (activation quantization is not supported",
        ),
        ({"config_groups": {"g": _group(num_bits=2)}}, "2-bit weights (only 4 or 8)"),
        ({"config_groups": {"g": _group(strategy="tensor")}}, "strategy 'tensor'"),
        ({"format": "int-quantized"}, "format 'int-quantized' is not supported"),
        ({"format": "float-quantized"}, "format 'float-quantized' is not supported"),
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
        ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme is not supported"),
        (
            {
                "config_groups": {
                    "g": _group() | {"weights": _group()["weights"] | {"actorder": "group"}}
                }
            },
            "actorder 'group'",
        ),
        ({"config_groups": {"a": _group(), "b": _group(num_bits=8)}}, "different weight schemes"),
    ],
)
def test_unsupported_variants_are_refused_at_launch(model_path, tmp_path, qc, cause) -> None:
    config = json.loads((model_path / "config.json").read_text()) | _config(**qc)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: quantization_config: ") as err:
        ModelConfig.from_dir(tmp_path)  # what the CLI reads before starting any worker
    assert cause in str(err.value) and str(tmp_path / "config.json") in str(err.value)


def test_supported_scheme_is_read() -> None:
    assert read_quantization({}, "c") is None
    assert read_quantization(_config(), "c") == PackScheme(4, "group", 64, True)
    qc = _config(config_groups={"g": _group(8, "channel", None, False)})
    assert read_quantization(qc, "c") == PackScheme(8, "channel", None, False)


def test_quantized_checkpoint_has_its_own_fingerprint(model_path, tmp_path) -> None:
    """A W4A16 copy of a model is not the float model for the KV handshake (its weights
    identity is ``ModelConfig.fingerprint()``)."""
    config = json.loads((model_path / "config.json").read_text()) | _config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    quantized, plain = ModelConfig.from_dir(tmp_path), ModelConfig.from_dir(model_path)
    assert quantized.weight_format == "compressed-tensors 4-bit group 64 symmetric"
    assert plain.weight_format == "" and quantized.fingerprint() != plain.fingerprint()
