"""bench/serving.py's ``--openvino`` peer: its arguments, and that the runner it starts in the
OpenVINO venv (bench/ov_pipeline.py) needs nothing of splitserve's venv."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from ov_peer import parse_spec
from serving import parse_args


def test_spec_names_the_run_or_takes_the_folder_name():
    assert parse_spec("OpenVINO int8=/x/m-ov-int8") == ("OpenVINO int8", "/x/m-ov-int8")
    assert parse_spec("/x/m-ov-fp16") == ("openvino m-ov-fp16", "/x/m-ov-fp16")


def test_openvino_alone_is_a_target_and_closed_loops_only():
    args = parse_args(["--openvino", "a=/m", "--openvino", "/n", "--concurrency", "1", "32"])
    assert args.openvino == ["a=/m", "/n"] and args.concurrency == [1, 32]
    with pytest.raises(SystemExit):
        parse_args(["--openvino", "/m", "--request-rate", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--openvino", "/m", "--prompt-format", "text"])


def test_runner_imports_only_openvino_numpy_and_the_standard_library():
    tree = ast.parse((BENCH / "ov_pipeline.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    third_party = roots - set(sys.stdlib_module_names)
    assert third_party == {"openvino", "openvino_genai", "numpy"}
