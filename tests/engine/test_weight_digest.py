"""The loaded weights' digest the KV handshake compares (``engine.model.weight_digest``): the
same on every load of one checkpoint, another for a checkpoint of the same config whose values
differ (two fine-tunes of one base), which ``ModelConfig.fingerprint()`` cannot tell apart."""

from __future__ import annotations

import torch

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import load_model
from splitserve.engine.model.weight_digest import SAMPLE, tensor_digest


def test_tensor_digest_sees_the_sampled_values() -> None:
    """A value changed at either end or at a strided sample changes the digest, as does the
    name, shape or dtype."""
    t = torch.arange(20 * SAMPLE, dtype=torch.float32)
    base = tensor_digest("w", t)
    assert tensor_digest("w", t.clone()) == base
    step = (t.numel() - 2 * SAMPLE) // SAMPLE
    for i in (0, SAMPLE - 1, SAMPLE, SAMPLE + 7 * step, t.numel() - 1):
        changed = t.clone()
        changed[i] += 0.5
        assert tensor_digest("w", changed) != base, i
    assert tensor_digest("v", t) != base
    assert tensor_digest("w", t.reshape(20, SAMPLE)) != base
    assert tensor_digest("w", t.double()) != base


def test_fine_tune_has_its_own_weights_digest(model, model_path, fine_tune_path) -> None:
    """Two checkpoints of one config (shapes equal, one tensor's values changed): the config
    fingerprints agree, the weights digests do not; one checkpoint loaded twice (two workers)
    gives one digest."""
    base = model[0].weights_digest  # the session's load of the default model
    assert len(base) == 16 and int(base, 16) >= 0
    assert load_model(model_path, torch.float32)[0].weights_digest == base
    tuned = load_model(fine_tune_path, torch.float32)[0].weights_digest
    assert tuned != base
    assert ModelConfig.from_dir(fine_tune_path).fingerprint() == model[1].fingerprint()
