"""Small LightningModules for the memory tests and the estimate-accuracy benchmark.

Each model trains with Adam on a random ``TensorDataset`` (fixed seed) and sets
``example_input_array`` (batch of 2) for torchinfo.

Example::

    >>> model = make_model("mlp")
    >>> loader = model.loader(batch_size=8)
    >>> next(iter(loader))[0].shape
    torch.Size([8, 256])
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

NUM_SAMPLES = 64
NUM_CLASSES = 10


class ClassifierModule(L.LightningModule):
    """A classifier over ``inputs`` (random features or tokens) trained with Adam and cross-entropy."""

    def __init__(self, network: nn.Module, inputs: torch.Tensor, batch_size: int = 32) -> None:
        super().__init__()
        self.network = network
        self.inputs = inputs
        self.batch_size = batch_size  # read by train_dataloader(): what BatchSizeSearch resizes
        self.example_input_array = inputs[:2].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return self.loader(self.batch_size)

    def loader(self, batch_size: int) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        targets = torch.randint(0, NUM_CLASSES, (len(self.inputs),), generator=generator)
        return DataLoader(TensorDataset(self.inputs, targets), batch_size=batch_size, shuffle=False)


class TokenClassifier(nn.Module):
    """Embedding + ``nn.TransformerEncoder`` + mean pooling + linear head."""

    def __init__(self, vocab: int = 1000, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens)).mean(dim=1))


class DataDependentNet(nn.Module):
    """A network whose forward needs real values: ``.item()`` and a branch on it."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(32, NUM_CLASSES)
        self.large = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().mean().item() > 10.0:
            return self.small(x)
        return self.large(x)


def make_model(name: str, num_samples: int = NUM_SAMPLES, batch_size: int = 32) -> ClassifierModule:
    """``"mlp"``, ``"cnn"`` (with BatchNorm), ``"transformer"`` or ``"data-dependent"``, with
    ``num_samples`` random training samples and ``batch_size`` for ``train_dataloader()``."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        network = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, NUM_CLASSES))
        inputs = torch.randn(num_samples, 256, generator=generator)
    elif name == "cnn":
        network = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, NUM_CLASSES),
        )  # fmt: skip
        inputs = torch.randn(num_samples, 3, 32, 32, generator=generator)
    elif name == "transformer":
        network = TokenClassifier()
        inputs = torch.randint(0, 1000, (num_samples, 32), generator=generator)
    elif name == "data-dependent":
        network = DataDependentNet()
        inputs = torch.randn(num_samples, 32, generator=generator)
    else:
        raise ValueError(f"unknown model {name!r}; expected 'mlp', 'cnn', 'transformer' or 'data-dependent'")
    return ClassifierModule(network, inputs, batch_size)
