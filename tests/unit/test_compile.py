"""``train.compile``: every block's forward through ``torch.compile`` gives the eager loss and gradients."""

from __future__ import annotations

from dataclasses import replace

import torch

from dhp.config import Config
from dhp.engine import ModuleEngine
from dhp.models.qwen2_5_vl.config import tiny
from dhp.models.qwen2_5_vl.family import FAMILY


def _step(compile_blocks: bool) -> tuple[float, dict[str, torch.Tensor], int]:
    """A one-layer tiny language model's summed loss and gradients on two packed samples, through the engine."""
    cfg = Config()
    cfg.train.compile = compile_blocks
    cfg.train.dtype = "float32"
    model_cfg = tiny(vocab_size=128, image_token_id=120, video_token_id=121)
    model_cfg = replace(model_cfg, text=replace(model_cfg.text, num_hidden_layers=1))
    engine = ModuleEngine(FAMILY.language, FAMILY, model_cfg, cfg)
    compiled = sum(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in engine.module.layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (1, 24), generator=g)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).view(1, 1, 24).expand(3, 1, 24).contiguous()
    targets = torch.randint(0, 128, (1, 24), generator=g)
    loss = engine.module.loss_sum(ids, pos, targets, None, torch.tensor([0, 10, 24]))
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in engine.module.named_parameters()}, compiled


def test_compiled_blocks_equal_eager():
    eager_loss, eager_grads, n_eager = _step(False)
    loss, grads, n = _step(True)
    assert (n_eager, n) == (0, 1)
    assert abs(loss - eager_loss) <= 1e-5 * abs(eager_loss)
    assert grads.keys() == eager_grads.keys()  # parameter names unchanged
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
