"""LightningModules in the shapes users write, for the estimate tests (tests/test_estimate_users_models.py).

* :class:`ResNetModule`: a small ResNet (BasicBlocks with BatchNorm and skip connections), SGD with
  momentum and ``OneCycleLR`` over ``self.trainer.estimated_stepping_batches`` (so
  ``configure_optimizers`` needs a Trainer), ``gradient_clip_val`` set on the Trainer by the test;
* :class:`GanModule`: manual optimization, a generator and a discriminator, two Adam optimizers
  stepped in ``training_step`` under ``manual_backward``;
* :class:`DictBatchModule` + :class:`DictDataModule`: batches are dicts ``{"features", "label"}``,
  the data lives in a DataModule (the module has no ``train_dataloader``);
* :class:`DataloaderIterModule`: ``training_step(self, dataloader_iter)``.

Example::

    >>> model = ResNetModule(width=8)
    >>> model(torch.zeros(2, 3, 16, 16)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

NUM_CLASSES = 10


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN, a skip connection (1x1 conv when the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.skip = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.skip = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNetModule(L.LightningModule):
    """A four-stage ResNet on random 3x``size``x``size`` images; SGD + OneCycleLR (needs ``self.trainer``)."""

    def __init__(self, width: int = 16, size: int = 32, num_samples: int = 256, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(
            BasicBlock(width, width),
            BasicBlock(width, 2 * width, 2),
            BasicBlock(2 * width, 4 * width, 2),
            BasicBlock(4 * width, 4 * width),
        )
        self.head = nn.Linear(4 * width, NUM_CLASSES)
        self.example_input_array = torch.zeros(2, 3, size, size)
        # made here, not in train_dataloader(): a budget entered at train start counts batches, not the data set
        self.images = torch.randn(num_samples, 3, size, size, generator=_generator())
        self.labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=_generator())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.1, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images, self.labels), batch_size=self.batch_size)


class GanModule(L.LightningModule):
    """A GAN with manual optimization: two Adam optimizers stepped in ``training_step``."""

    def __init__(self, latent: int = 32, features: int = 64, hidden: int = 256, batch_size: int = 16) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = batch_size
        self.latent, self.features = latent, features
        self.generator = nn.Sequential(
            nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, features)
        )
        self.discriminator = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], self.latent, device=real.device, dtype=real.dtype)
        fake = self.generator(z)
        ones = torch.ones(real.shape[0], 1, device=real.device)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), torch.zeros_like(ones))
        d_opt.zero_grad()
        self.manual_backward((real_loss + fake_loss) / 2)
        d_opt.step()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=2e-4),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-4),
        ]

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(256, self.features, generator=_generator())
        return DataLoader(TensorDataset(data), batch_size=self.batch_size)


class DictDataset(Dataset):
    """Samples as dicts: ``{"features": (features,), "label": ()}``."""

    def __init__(self, count: int, features: int) -> None:
        self.features = torch.randn(count, features, generator=_generator())
        self.labels = torch.randint(0, NUM_CLASSES, (count,), generator=_generator())

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[index], "label": self.labels[index]}


class DictDataModule(L.LightningDataModule):
    """The data of :class:`DictBatchModule`: dict batches of ``batch_size``."""

    def __init__(self, features: int = 256, num_samples: int = 512, batch_size: int = 16) -> None:
        super().__init__()
        self.features, self.num_samples, self.batch_size = features, num_samples, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(DictDataset(self.num_samples, self.features), batch_size=self.batch_size)


class DictBatchModule(L.LightningModule):
    """An MLP over dict batches; AdamW; no dataloader of its own (it comes with a DataModule)."""

    def __init__(self, features: int = 256, hidden: int = 1024, layers: int = 2) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.net = nn.Sequential(*blocks, nn.Linear(width, NUM_CLASSES))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch["features"]), batch["label"])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class DataloaderIterModule(L.LightningModule):
    """``training_step(self, dataloader_iter)``: the step pulls its own batch."""

    def __init__(self, features: int = 32, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, NUM_CLASSES))
        self.features = features

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:
        batch, _, _ = next(dataloader_iter)
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(64, self.features, generator=_generator())
        y = torch.randint(0, NUM_CLASSES, (64,), generator=_generator())
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)
