"""Two small LightningModules on synthetic data, for examples, benchmarks and ``gpuopt estimate``.

Both build their data in memory from a fixed seed (no downloads), read ``self.batch_size`` in
``train_dataloader()`` (the attribute ``BatchSizeSearch`` resizes), and repeat one block class
(what activation checkpointing wraps):

* :class:`TokenTransformer`: next-token prediction on arithmetic sequences modulo ``vocab``;
  embedding + ``depth`` :class:`TransformerBlock` in an ``nn.ModuleList`` + a linear head.
* :class:`ResidualConvNet`: image classification of noisy class prototypes; a conv stem +
  ``depth`` :class:`ResidualBlock` in an ``nn.Sequential`` + pooling and a linear head.

At their default sizes a training step takes a few milliseconds on a CPU; their arguments scale
them up for a GPU.

Example::

    >>> model = TokenTransformer(depth=2, batch_size=4)
    >>> tokens, targets = next(iter(model.train_dataloader()))
    >>> tokens.shape, model(tokens).shape
    (torch.Size([4, 32]), torch.Size([4, 32, 256]))
    >>> images, labels = next(iter(ResidualConvNet(batch_size=4).train_dataloader()))
    >>> images.shape
    torch.Size([4, 3, 16, 16])

From the command line::

    gpuopt estimate examples/models.py:TokenTransformer --init-args '{"width": 256, "depth": 8}' --batch-size 64
    gpuopt estimate examples/models.py:ResidualConvNet --batch-size 128 --max-memory 2GiB
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"`width`={width} must be a multiple of `heads`={heads}, e.g. width=64, heads=4.")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TokenTransformer(L.LightningModule):
    """A small causal language model on synthetic sequences ``start, start + step, ...`` mod ``vocab``.

    Args:
        vocab: number of token ids.
        width: embedding width.
        depth: number of :class:`TransformerBlock`.
        heads: attention heads per block.
        seq_len: tokens per sample.
        num_samples: sequences in the synthetic dataset.
        batch_size: samples per batch of ``train_dataloader()``.
        lr: AdamW's learning rate.

    Example::

        gpuopt estimate examples/models.py:TokenTransformer --batch-size 8 --max-memory 200MB
    """

    def __init__(
        self,
        vocab: int = 256,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        seq_len: int = 32,
        num_samples: int = 512,
        batch_size: int = 32,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.example_input_array = self._sequences(2)[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        tokens, targets = self._sequences(self.hparams.num_samples)
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(tokens, targets), batch_size=self.batch_size, shuffle=True, generator=generator)

    def _sequences(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        vocab, length = self.hparams.vocab, self.hparams.seq_len
        start = torch.randint(0, vocab, (count, 1), generator=generator)
        step = torch.randint(1, 8, (count, 1), generator=generator)
        sequences = (start + step * torch.arange(length + 1)) % vocab
        return sequences[:, :-1], sequences[:, 1:]


class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the input, then relu (a ResNet basic block, constant width)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class ResidualConvNet(L.LightningModule):
    """A small ResNet classifying synthetic images: noise around one random prototype per class.

    Args:
        channels: width of the stem and every block.
        depth: number of :class:`ResidualBlock`.
        image_size: height and width of the square RGB images.
        num_classes: classes (and prototypes).
        num_samples: images in the synthetic dataset.
        batch_size: samples per batch of ``train_dataloader()``.
        lr: Adam's learning rate.

    Example::

        gpuopt estimate examples/models.py:ResidualConvNet --init-args '{"channels": 64}' --batch-size 32
    """

    def __init__(
        self,
        channels: int = 16,
        depth: int = 3,
        image_size: int = 16,
        num_classes: int = 10,
        num_samples: int = 512,
        batch_size: int = 32,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*(ResidualBlock(channels) for _ in range(depth)))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))
        self.example_input_array = torch.zeros(2, 3, image_size, image_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        images, labels = self._images(self.hparams.num_samples)
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(images, labels), batch_size=self.batch_size, shuffle=True, generator=generator)

    def _images(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        size, classes = self.hparams.image_size, self.hparams.num_classes
        prototypes = torch.randn(classes, 3, size, size, generator=generator)
        labels = torch.randint(0, classes, (count,), generator=generator)
        images = prototypes[labels] + 0.5 * torch.randn(count, 3, size, size, generator=generator)
        return images, labels
