"""``bench/quality.py``'s decode-step scoring (``--decode``) against its prompt-step scoring: in
float32 on a tiny random Llama both compute the same logits, so the teacher-forced batch of
one-token steps feeds each window's tokens at the right positions and pages."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from quality import decode_logits, window_logits

from splitserve.config import EngineConfig
from splitserve.engine.model.loader import load_model


def test_decode_steps_score_what_a_prompt_step_scores(tmp_path) -> None:
    import transformers

    from tests.engine.test_model_vs_hf import COMMON

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON))
    hf.save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path, torch.float32, engine=EngineConfig())
    gen = torch.Generator().manual_seed(1)
    vocab = COMMON["vocab_size"]
    # Windows of different lengths (one ends early, one spans two pages of 16).
    windows = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (20, 7, 33)]
    with torch.inference_mode():
        got = decode_logits(model, cfg, windows, "float32")
        for w, g in zip(windows, got, strict=True):
            want = window_logits(model, cfg, w, "float32")
            assert g.shape == want.shape == (len(w), vocab)
            torch.testing.assert_close(g, want, atol=1e-4, rtol=0)
        # A shuffled window scores differently: the comparison above is not vacuous.
        shuffled = decode_logits(model, cfg, [windows[0][::-1]], "float32")[0]
        assert float((shuffled - got[0]).abs().max()) > 1e-3
