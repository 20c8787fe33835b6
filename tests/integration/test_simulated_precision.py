"""Precision on a simulated card runs as on the card: a ``Trainer(precision="16-mixed")`` made inside
``SimulatedGpu`` keeps float16 autocast with a GradScaler (a CPU Trainer alone runs bf16-mixed), so the
scaler's path (unscale before clipping, a step skipped on inf) runs in CI; and MemoryFill's plan says the
user set a precision only where the user did, never where Lightning chose it."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from helpers import quiet_trainer
from lightning import Callback, LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import MemoryFill
from lightning_gpuopt.testing import SimulatedGpu

LR, CLIP = 0.1, 0.001


class Overflowing(LightningModule):
    """One linear layer, SGD; the first step's output overflows float16 (not float32 or bfloat16)."""

    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)
        self.batch_size = batch_size
        self.output_dtypes: list[torch.dtype] = []
        self.inputs = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.layer(batch[0])
        self.output_dtypes.append(out.dtype)
        return 0.01 * (out * (1e5 if batch_idx == 0 else 1.0)).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.inputs), batch_size=self.batch_size)


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([tensor.detach().flatten() for tensor in tensors])


class Steps(Callback):
    """Per step: the scale and parameters before, the gradients the optimizer step sees, the scale and parameters after."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append(dict(scale=trainer.scaler.get_scale(), params=flat(pl_module.parameters())))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # after unscale_, before clipping
        self.steps[-1]["grad"] = flat(p.grad for p in pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps[-1].update(scale_after=trainer.scaler.get_scale(), params_after=flat(pl_module.parameters()))


def test_16_mixed_on_a_simulated_t4_scales_skips_the_inf_step_and_clips_unscaled_gradients(tmp_path):
    model, steps = Overflowing(), Steps()
    start = copy.deepcopy(model.layer)
    with SimulatedGpu("T4"):
        trainer = quiet_trainer(tmp_path, [steps], max_steps=2, precision="16-mixed", gradient_clip_val=CLIP)
        trainer.fit(model)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed"
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and model.output_dtypes == [torch.float16] * 2
    inf_step, step = steps.steps
    # the overflowing step: gradients not finite, the optimizer step skipped, the scale halved
    assert not torch.isfinite(inf_step["grad"]).all()
    assert torch.equal(inf_step["params_after"], flat(start.parameters()))
    assert inf_step["scale_after"] == inf_step["scale"] / 2 == step["scale"] == step["scale_after"] == 2.0**15
    # the next step: the gradient unscaled (the step's own, computed by hand without a scaler), then clipped
    start.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = start(model.inputs[16:])
    (0.01 * out.float().pow(2).mean()).backward()
    torch.testing.assert_close(step["grad"], flat(p.grad for p in start.parameters()), rtol=1e-3, atol=0)
    norm = float(torch.linalg.vector_norm(step["grad"]))
    assert norm > 10 * CLIP  # clipping changes this step
    expected = flat(start.parameters()) - LR * step["grad"] * CLIP / norm
    torch.testing.assert_close(step["params_after"], expected, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize(("simulated", "reason"), [
    (True, "precision='16-mixed' was set explicitly: left as it is"),
    (False, "precision='bf16-mixed' was set explicitly, or Lightning chose it (on CPU it runs '16-mixed' as "
            "'bf16-mixed'): left as it is"),
])  # fmt: skip
def test_memory_fill_says_the_user_set_16_mixed_only_where_lightning_kept_it(tmp_path, simulated, reason):
    model = Overflowing()
    fill = MemoryFill(
        global_batch_size=16,
        max_memory="64MiB",
        accumulation=False,
        activation_checkpointing=False,
        precision="bf16-mixed",
    )
    with SimulatedGpu("T4") if simulated else contextlib.nullcontext():
        quiet_trainer(tmp_path, [fill], max_steps=1, precision="16-mixed").fit(model)
    assert fill.plan.precision == ("16-mixed" if simulated else "bf16-mixed")
    assert reason in fill.plan.reasons and fill.plan.changes == []
