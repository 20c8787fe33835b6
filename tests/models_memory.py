"""Small LightningModules for the memory tests and the estimate-accuracy benchmark.

Each model trains with Adam on a random ``TensorDataset`` (fixed seed) and sets
``example_input_array`` (batch of 2) for torchinfo. ``"decoder"`` and ``"unet"`` are held out:
the estimate was not tuned on them (a causal-attention language model and a segmentation U-Net).

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
MODELS = ("mlp", "cnn", "transformer", "data-dependent", "decoder", "unet")


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
        loss = self.loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy; the class dimension is 1 (per-pixel classes for a segmentation output)."""
        return F.cross_entropy(output, targets)

    def targets(self, generator: torch.Generator) -> torch.Tensor:
        """One class per sample."""
        return torch.randint(0, NUM_CLASSES, (len(self.inputs),), generator=generator)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return self.loader(self.batch_size)

    def loader(self, batch_size: int) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(self.inputs, self.targets(generator)), batch_size=batch_size, shuffle=False)


class LanguageModelModule(ClassifierModule):
    """Next-token prediction: the targets are the input tokens shifted by one; cross-entropy over
    the vocabulary at every position (logits flattened to ``(batch * tokens, vocab)``, as nanoGPT)."""

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), targets.flatten())

    def targets(self, generator: torch.Generator) -> torch.Tensor:
        vocab = self.network.embedding.num_embeddings
        following = torch.randint(0, vocab, (len(self.inputs), 1), generator=generator)
        return torch.cat([self.inputs[:, 1:], following], dim=1)


class SegmentationModule(ClassifierModule):
    """One class per pixel: targets ``(batch, height, width)``."""

    def targets(self, generator: torch.Generator) -> torch.Tensor:
        _, _, height, width = self.inputs.shape
        return torch.randint(0, NUM_CLASSES, (len(self.inputs), height, width), generator=generator)


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


class DecoderBlock(nn.Module):
    """Pre-norm GPT block: causal ``F.scaled_dot_product_attention`` and a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).contiguous().view(batch, tokens, width))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """A small GPT: token and position embeddings, ``DecoderBlock``s, final LayerNorm, a vocabulary head."""

    def __init__(self, vocab: int = 512, width: int = 64, heads: int = 4, layers: int = 2, tokens: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Embedding(tokens, width)
        self.blocks = nn.Sequential(*[DecoderBlock(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.embedding(tokens) + self.position(positions))))


def conv_bn_relu(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU())


class UNet(nn.Module):
    """A two-level U-Net: conv-BN-ReLU, max-pool down, ``ConvTranspose2d`` up, skip connections
    concatenated, a 1x1 convolution to per-pixel classes."""

    def __init__(self, channels: int = 3, width: int = 16, classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.down1, self.down2 = conv_bn_relu(channels, width), conv_bn_relu(width, 2 * width)
        self.bottom = conv_bn_relu(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.merge2 = conv_bn_relu(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.merge1 = conv_bn_relu(2 * width, width)
        self.out = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip1 = self.down1(x)
        skip2 = self.down2(F.max_pool2d(skip1, 2))
        x = self.bottom(F.max_pool2d(skip2, 2))
        x = self.merge2(torch.cat([self.up2(x), skip2], dim=1))
        x = self.merge1(torch.cat([self.up1(x), skip1], dim=1))
        return self.out(x)


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
    """``"mlp"``, ``"cnn"`` (with BatchNorm), ``"transformer"``, ``"data-dependent"``, or the held-out
    ``"decoder"`` (causal SDPA, next-token loss over a 512-token vocabulary) and ``"unet"``
    (per-pixel classes), with ``num_samples`` random training samples and ``batch_size`` for
    ``train_dataloader()``."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        network = nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, NUM_CLASSES)
        )
        inputs = torch.randn(num_samples, 256, generator=generator)
    elif name == "cnn":
        network = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, NUM_CLASSES),
        )
        inputs = torch.randn(num_samples, 3, 32, 32, generator=generator)
    elif name == "transformer":
        network = TokenClassifier()
        inputs = torch.randint(0, 1000, (num_samples, 32), generator=generator)
    elif name == "data-dependent":
        network = DataDependentNet()
        inputs = torch.randn(num_samples, 32, generator=generator)
    elif name == "decoder":
        network = Decoder()
        inputs = torch.randint(0, 512, (num_samples, 32), generator=generator)
        return LanguageModelModule(network, inputs, batch_size)
    elif name == "unet":
        network = UNet()
        inputs = torch.randn(num_samples, 3, 32, 32, generator=generator)
        return SegmentationModule(network, inputs, batch_size)
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(map(repr, MODELS))}")
    return ClassifierModule(network, inputs, batch_size)
