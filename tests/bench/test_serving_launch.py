"""bench/serving.py's ``--launch MODE[:int8|:int4][:kv8][:ngram][:split]`` becomes the cluster's
config fields."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from common import launch_fields

from splitserve.config import ServeConfig


def test_plain_mode_has_bf16_weights_and_no_speculation():
    assert launch_fields("colocated", 4) == ("colocated", "splitserve colocated",
                                             {"quantization": "none"})


def test_quantization_and_ngram_options_become_config_fields():
    mode, name, fields = launch_fields("disaggregated:int8:ngram", 3)
    assert (mode, name) == ("disaggregated", "splitserve disaggregated int8 ngram")
    assert fields == {"quantization": "int8", "speculative": "ngram", "num_speculative_tokens": 3}
    config = ServeConfig.from_fields(model="m", colocated=False, **fields)
    assert config.engine.speculative == "ngram"
    assert config.engine.num_speculative_tokens == 3


def test_kv8_option_is_an_int8_kv_cache():
    mode, name, fields = launch_fields("colocated:int8:kv8", 4)
    assert (mode, name) == ("colocated", "splitserve colocated int8 kv8")
    assert fields == {"quantization": "int8", "kv_cache_dtype": "int8"}
    assert ServeConfig.from_fields(model="m", **fields).engine.kv_cache_dtype == "int8"


def test_split_option_turns_the_core_share_off():
    mode, name, fields = launch_fields("disaggregated:split", 4)
    assert (mode, name) == ("disaggregated", "splitserve disaggregated split")
    assert fields == {"quantization": "none", "share_cores": False}
    assert ServeConfig.from_fields(model="m", **fields).cluster.share_cores is False
    assert ServeConfig.from_fields(model="m").cluster.share_cores is True  # on by default


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="eagle"):
        launch_fields("colocated:eagle", 4)
