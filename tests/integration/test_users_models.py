"""Users' model shapes: a right answer or a clear refusal from MemoryFill and GpuOpt, never a wrong number.

Each shape is written the way its family writes it -- HuggingFace GPT-2 built from a config (dict
batches, padded variable-length sequences, ``use_cache`` left at its default), a timm-style CNN
(stages of ``nn.Sequential`` blocks with BatchNorm and a drop-path that draws from the RNG), a
torchvision-style ResNet (BasicBlocks with a downsample), an LSTM on packed padded sequences, an
MLP and a GAN (manual optimization) -- tiny, and trained for a few real steps on CPU under a
simulated memory budget. Truth is a run written by hand: the model's own checkpointing switch, or
plain training, at the micro-batch and accumulation the plan chose.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
from helpers import quiet_trainer
from lightning import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_gpuopt import GpuOpt, MemoryEstimator
from lightning_gpuopt.callbacks.memory_fill import MemoryFill
from lightning_gpuopt.core.checkpointing import (
    check_recomputation,
    enable_checkpointing,
    enable_native_checkpointing,
    find_repeated_blocks,
    native_checkpointing_owners,
)

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

BUDGET = "200MB"  # every model here fits it whole: the plans are driven by the settings, not the budget
VOCAB = 100


def trainer_for(tmp_path, callbacks: list, **kwargs: Any) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, **{"max_steps": 4, **kwargs})


def parameters_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def assert_same_parameters(ours: nn.Module, by_hand: nn.Module, exact: bool = True) -> None:
    mine, theirs = parameters_of(ours), parameters_of(by_hand)
    assert mine.keys() == theirs.keys()
    for name in mine:
        if exact:
            assert torch.equal(mine[name], theirs[name]), name
        else:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- HuggingFace GPT-2


class TokenSequences(Dataset):
    """Token sequences of 4 to 24 tokens (variable length: batches are padded)."""

    def __init__(self, size: int = 48) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(4, 25, (size,), generator=generator).tolist()
        self.sequences = [torch.randint(1, VOCAB, (length,), generator=generator) for length in lengths]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sequences[index]


def pad_tokens(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a tokenizer's padding collator gives: input_ids, attention_mask and labels (-100 on padding)."""
    longest = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = sequence
        attention_mask[row, : len(sequence)] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(attention_mask == 0, -100),
    }


class TokenData(LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenSequences(), batch_size=self.batch_size, shuffle=True, collate_fn=pad_tokens)


class GPT2Module(LightningModule):
    """GPT-2 with its default config (dropout 0.1, ``use_cache=True``), but tiny."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit_gpt2(tmp_path, callbacks: list, batch_size: int = 4, own_checkpointing: bool = False, **kwargs: Any):
    torch.manual_seed(1)
    module, data = GPT2Module(), TokenData(batch_size)
    if own_checkpointing:  # by hand, as the transformers docs say
        module.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        module.model.config.use_cache = False
    torch.manual_seed(2)
    trainer_for(tmp_path, callbacks, **kwargs).fit(module, datamodule=data)
    return module


def test_gpt2_checkpointing_uses_the_models_own_switch_and_equals_it_by_hand(tmp_path):
    fill = MemoryFill(activation_checkpointing=True, max_memory=BUDGET, global_batch_size=8)
    ours = fit_gpt2(tmp_path / "ours", [fill])
    plan = fill.plan
    assert plan.checkpointing and plan.checkpointed_classes == ["GPT2Block"]
    assert plan.checkpointed_modules == ["model.transformer.h.0", "model.transformer.h.1"]
    assert any(
        "GPT2LMHeadModel.activation_checkpointing_enable()" in r and "recomputation checked" in r for r in plan.reasons
    )
    # teardown put the model back: no checkpointing flag, its cache setting and no input-grad hook
    assert not ours.model.is_activation_checkpointing and ours.model.config.use_cache is True
    assert not getattr(ours.model, "_require_grads_hooks", None)
    by_hand = fit_gpt2(
        tmp_path / "hand",
        [],
        batch_size=plan.micro_batch_size,
        own_checkpointing=True,
        accumulate_grad_batches=plan.accumulate_grad_batches,
    )
    assert_same_parameters(ours, by_hand)


def test_gpt2_low_memory_trains_checkpointed_and_equals_plain_training(tmp_path):
    gpuopt = GpuOpt("low-memory", max_memory=BUDGET, global_batch_size=16, monitor=False, estimate=False)
    ours = fit_gpt2(tmp_path / "ours", [gpuopt], max_steps=2)
    plan = gpuopt.report.memory_fill
    assert plan.checkpointing and (plan.micro_batch_size, plan.accumulate_grad_batches) == (8, 2)
    plain = fit_gpt2(tmp_path / "plain", [], batch_size=8, accumulate_grad_batches=2, max_steps=2)
    assert_same_parameters(ours, plain, exact=False)  # recomputed activations: the same up to rounding


def test_gpt2_blocks_named_by_the_user_are_checkpointed_by_us_with_the_cache_cleared(tmp_path):
    # the user's class list: our torch.utils.checkpoint wrapper, not the model's switch; GPT2Model hands
    # each block the cache positionally, and the recomputation must not see it grown by the first pass
    fill = MemoryFill(activation_checkpointing=["GPT2Block"], max_memory=BUDGET, global_batch_size=8)
    ours = fit_gpt2(tmp_path / "ours", [fill], max_steps=2)
    plan = fill.plan
    assert plan.checkpointed_classes == ["GPT2Block"] and not ours.model.is_activation_checkpointing
    assert any("(torch.utils.checkpoint; recomputation checked" in reason for reason in plan.reasons)
    plain = fit_gpt2(
        tmp_path / "plain",
        [],
        batch_size=plan.micro_batch_size,
        max_steps=2,
        accumulate_grad_batches=plan.accumulate_grad_batches,
    )
    assert_same_parameters(ours, plain, exact=False)


# ----------------------------------------------------------------------------- timm-style CNN, ResNet


class DropPath(nn.Module):
    """timm's stochastic depth: drops a sample's residual branch with probability ``p`` (draws from the RNG)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = torch.empty(x.shape[0], *([1] * (x.dim() - 1)), device=x.device).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)
        self.drop_path = DropPath(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(F.relu(self.norm(self.conv(x))))


class TimmStyleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stages = nn.Sequential(
            nn.Sequential(ConvBlock(8), ConvBlock(8)),
            nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), ConvBlock(16), ConvBlock(16)),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with its optional downsample."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNetStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, stride=2), BasicBlock(16, 16))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return self.fc(self.layer2(self.layer1(x)).mean(dim=(2, 3)))


class ImageClassifier(LightningModule):
    def __init__(self, network: nn.Module, batch_size: int = 4) -> None:
        super().__init__()
        self.network = network
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(64, 3, 16, 16, generator=generator), torch.randint(0, 10, (64,), generator=generator)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.network(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


# the repeated blocks of a timm-style net are its stages (same-class children of ``stages``); a ResNet's, its BasicBlocks
@pytest.mark.parametrize("network, blocks", [(TimmStyleNet, "Sequential"), (ResNetStyle, "BasicBlock")])
def test_cnn_low_memory_checkpoints_blocks_and_equals_plain_training(tmp_path, network, blocks):
    torch.manual_seed(0)
    model = ImageClassifier(network())
    plain = copy.deepcopy(model)
    gpuopt = GpuOpt("low-memory", max_memory=BUDGET, global_batch_size=16, monitor=False, estimate=False)
    torch.manual_seed(2)
    trainer_for(tmp_path / "ours", [gpuopt], max_steps=2).fit(model)
    plan = gpuopt.report.memory_fill
    assert plan.checkpointed_classes == [blocks] and (plan.micro_batch_size, plan.accumulate_grad_batches) == (8, 2)
    assert any("recomputation checked" in reason for reason in plan.reasons)
    plain.batch_size = 8
    torch.manual_seed(2)
    trainer_for(tmp_path / "plain", [], max_steps=2, accumulate_grad_batches=2).fit(plain)
    # BatchNorm statistics and drop-path masks included: the recomputation replays the same draws
    assert_same_parameters(model, plain, exact=False)


class TinyConvConfig(transformers.PretrainedConfig):
    model_type = "tiny-conv"

    def __init__(self, channels: int = 8, num_layers: int = 2, num_labels: int = 10, **kwargs: Any) -> None:
        super().__init__(num_labels=num_labels, **kwargs)
        self.channels, self.num_layers = channels, num_layers


class TinyConvLayer(GradientCheckpointingLayer):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x)))


class TinyConvModel(transformers.PreTrainedModel):
    """A HuggingFace model the way HF's vision models are written (MobileViT, ...): it checkpoints
    itself through GradientCheckpointingLayers that hold BatchNorm."""

    config_class = TinyConvConfig
    supports_gradient_checkpointing = True
    main_input_name = "pixel_values"

    def __init__(self, config: TinyConvConfig) -> None:
        super().__init__(config)
        self.stem = nn.Conv2d(3, config.channels, 3, padding=1)
        self.layers = nn.ModuleList([TinyConvLayer(config.channels) for _ in range(config.num_layers)])
        self.head = nn.Linear(config.channels, config.num_labels)
        self.post_init()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.stem(pixel_values)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=(2, 3)))


def test_hf_mobilevits_own_checkpointing_updates_batchnorm_twice_ours_does_not():
    """The independent fact the next test builds on, on a real HF model: its own switch runs
    BatchNorm again in the recomputation (running statistics updated twice); ours puts them back."""
    torch.manual_seed(0)
    config = transformers.MobileViTConfig(
        image_size=16,
        patch_size=2,
        hidden_sizes=[16, 16, 16],
        num_labels=3,
        neck_hidden_sizes=[8, 8, 8, 16, 16, 16, 32],
        num_attention_heads=2,
    )
    model = transformers.MobileViTForImageClassification(config).train()
    batch = (torch.randn(2, 3, 16, 16), torch.tensor([0, 2]))
    loss = lambda b: model(pixel_values=b[0], labels=b[1]).loss  # noqa: E731
    own = enable_native_checkpointing(native_checkpointing_owners(model))
    assert own.classes == ["MobileViTLayer"]
    assert "running_mean differs" in check_recomputation(model, loss, batch, own)
    own.remove()
    ours = enable_checkpointing(find_repeated_blocks(model))
    assert check_recomputation(model, loss, batch, ours) is None
    ours.remove()


def test_a_models_own_checkpointing_that_updates_batchnorm_twice_is_replaced_by_ours(tmp_path):
    torch.manual_seed(0)
    model = ImageClassifier(TinyConvModel(TinyConvConfig()))
    plain = copy.deepcopy(model)
    fill = MemoryFill(activation_checkpointing=True, max_memory=BUDGET, global_batch_size=8)
    torch.manual_seed(2)
    trainer_for(tmp_path / "ours", [fill], max_steps=2).fit(model)
    plan = fill.plan
    replaced = [r for r in plan.reasons if r.startswith("TinyConvModel.activation_checkpointing_enable() refused")]
    assert replaced and "running_mean differs" in replaced[0] and "torch.utils.checkpoint on its blocks" in replaced[0]
    assert plan.checkpointed_classes == ["TinyConvLayer"]
    assert any("(torch.utils.checkpoint; recomputation checked" in reason for reason in plan.reasons)
    assert not model.network.is_activation_checkpointing
    plain.batch_size = plan.micro_batch_size
    torch.manual_seed(2)
    trainer_for(tmp_path / "plain", [], max_steps=2, accumulate_grad_batches=plan.accumulate_grad_batches).fit(plain)
    assert_same_parameters(model, plain, exact=False)  # running statistics included


# ----------------------------------------------------------------------------- no repeated blocks


class PaddedSequences(LightningModule):
    """An LSTM tagger on padded variable-length sequences (packed for the LSTM)."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.embedding = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 2)
        generator = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(3, 20, (48,), generator=generator)
        tokens = torch.randint(1, VOCAB, (48, 20), generator=generator)
        self.tokens = tokens.masked_fill(torch.arange(20) >= self.lengths[:, None], 0)
        self.labels = torch.randint(0, 2, (48,), generator=generator)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, lengths, labels = batch
        packed = pack_padded_sequence(self.embedding(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (hidden, _) = self.lstm(packed)
        return F.cross_entropy(self.head(hidden[-1]), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.tokens, self.lengths, self.labels), batch_size=self.batch_size)


class MLPClassifier(LightningModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(64, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class GAN(LightningModule):
    """A GAN the Lightning way: manual optimization, a generator and a discriminator step per batch."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = batch_size
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.data = TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(0)))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        noise = torch.randn(real.shape[0], 8, device=real.device)
        fake = self.generator(noise)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(real.shape[0], 1))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        logits = self.discriminator(torch.cat([real, fake.detach()]))
        targets = torch.cat([torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)])
        d_loss = F.binary_cross_entropy_with_logits(logits, targets)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        ]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


def info_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "MemoryFill" in r.getMessage()]


@pytest.mark.parametrize(
    "make, micro, accumulate",
    [
        (PaddedSequences, 8, 2),
        (MLPClassifier, 8, 2),
        (GAN, 16, 1),  # manual optimization: no accumulation
    ],
)
def test_low_memory_without_repeated_blocks_falls_back_and_says_so(tmp_path, caplog, make, micro, accumulate):
    torch.manual_seed(0)
    model = make()
    plain = copy.deepcopy(model)
    gpuopt = GpuOpt("low-memory", max_memory=BUDGET, global_batch_size=16, monitor=False, estimate=False)
    with caplog.at_level(logging.INFO):
        torch.manual_seed(2)
        trainer_for(tmp_path / "ours", [gpuopt], max_steps=2).fit(model)
    plan = gpuopt.report.memory_fill
    assert not plan.checkpointing
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (micro, accumulate)
    said = [reason for reason in plan.reasons if "no repeated blocks" in reason]
    assert said and f"in {make.__name__}" in said[0] and "falls back to the smallest micro-batch" in said[0]
    assert any(said[0] in message for message in info_records(caplog))  # the rank-zero info line
    plain.batch_size = micro
    torch.manual_seed(2)
    trainer_for(tmp_path / "plain", [], max_steps=2, accumulate_grad_batches=accumulate).fit(plain)
    assert_same_parameters(model, plain)  # the settings written by hand, bit for bit


def test_explicit_checkpointing_on_a_model_without_blocks_refuses_naming_it(tmp_path):
    fill = MemoryFill(activation_checkpointing=True, max_memory=BUDGET, global_batch_size=16)
    with pytest.raises(
        MisconfigurationException,
        match=r"no repeated blocks in PaddedSequences .* no submodule with "
        r"parameters .* activation_checkpointing='auto'",
    ):
        trainer_for(tmp_path, [fill]).fit(PaddedSequences())
    # a model with blocks of its own, just not repeated ones: they are named
    model = ImageClassifier(nn.Sequential(ConvBlock(3), nn.Flatten(), nn.Linear(3 * 16 * 16, 10)))
    with pytest.raises(
        MisconfigurationException, match=r"in ImageClassifier .* e\.g\. activation_checkpointing=\['ConvBlock'\]"
    ):
        trainer_for(tmp_path, [MemoryFill(activation_checkpointing=True, max_memory=BUDGET)]).fit(model)


# ----------------------------------------------------------------------------- a block that cannot be recomputed


class CountingBlock(nn.Module):
    """A block whose forward changes the model's state: each call advances a step counter that
    scales its output (a recomputation sees the counter one further)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.norm(self.linear(x)) * (1 + self.calls % 2)


class CountingModel(MLPClassifier):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__(batch_size)
        self.net = nn.Sequential(CountingBlock(), CountingBlock(), nn.Linear(32, 10))


def test_a_block_whose_recomputation_differs_is_refused_with_the_reason(tmp_path, caplog):
    gpuopt = GpuOpt("low-memory", max_memory=BUDGET, global_batch_size=16, monitor=False, estimate=False)
    torch.manual_seed(0)
    model = CountingModel()
    with caplog.at_level(logging.INFO):
        trainer_for(tmp_path, [gpuopt], max_steps=2).fit(model)
    plan = gpuopt.report.memory_fill
    assert not plan.checkpointing
    refused = [reason for reason in plan.reasons if "refused for 2 CountingBlock blocks" in reason]
    assert refused and "differs from a plain one" in refused[0]
    assert any(refused[0] in message for message in info_records(caplog))
    # the check left no trace: each training step called each block once, as plain training does
    assert [float(block.calls) for block in model.net[:2]] == [4.0, 4.0]  # 2 steps x 2 micro-batches
    with pytest.raises(
        MisconfigurationException,
        match=r"activation_checkpointing=True on CountingModel: a training step "
        r"with its CountingBlock blocks checkpointed differs",
    ):
        trainer_for(tmp_path, [MemoryFill(activation_checkpointing=True, max_memory=BUDGET)]).fit(CountingModel())


# ----------------------------------------------------------------------------- an estimate that cannot trace


class PerSampleBias(MLPClassifier):
    """Holds a parameter shaped by its batch size: a real step at that size runs, the estimate's
    trace at twice the size cannot (a broadcast error inside a fake kernel)."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(batch_size)
        self.per_sample = nn.Parameter(torch.zeros(batch_size, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x) + self.per_sample, y)


@pytest.mark.parametrize(
    "callback",
    [
        lambda: MemoryEstimator(max_memory=BUDGET),
        lambda: MemoryFill(
            max_memory=BUDGET, global_batch_size=8, activation_checkpointing=False
        ),  # the search's estimate
    ],
)
def test_an_estimate_that_cannot_trace_is_one_warning_and_no_error_log(tmp_path, caplog, callback):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG):
        warnings.simplefilter("always")
        trainer_for(tmp_path, [callback()], max_steps=1).fit(PerSampleBias())
    ours = [str(w.message) for w in caught if "could not be traced" in str(w.message)]
    assert len(ours) == 1, ours
    assert "RuntimeError: Attempting to broadcast a dimension" in ours[0] and "\n" not in ours[0]
    assert [r.getMessage()[:80] for r in caplog.records if r.levelno >= logging.ERROR] == []
