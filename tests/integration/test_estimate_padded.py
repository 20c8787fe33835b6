"""The estimate on padded variable-length data: it traces a batch of the longest sample (a map-style
dataset), or says that it traced the first batch (a stream), with real Trainers on CPU."""

from __future__ import annotations

import json
from typing import Optional

import pytest
import torch
from helpers import profiler_peak_bytes, quiet_trainer
from lightning import LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_gpuopt import MemoryEstimator, cli

VOCAB, BATCH = 50, 8
#: the first two batches are 8 tokens long; the longest sample (64 tokens) comes later
LENGTHS = [8] * 16 + list(range(9, 65))


class Sequences(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, VOCAB, (length,), generator=generator) for length in LENGTHS]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(Sequences().items)


def pad_tokens(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a tokenizer's padding collator gives: padded to the batch's longest sequence."""
    input_ids = nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    attention_mask = (input_ids != 0).long()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(input_ids == 0, -100),
    }


class TinyBert(LightningModule):
    def __init__(self, data: Optional[Dataset] = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.data = Sequences() if data is None else data
        self.embedding = nn.Embedding(VOCAB, 32)
        self.encoder = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        padding = batch["attention_mask"] == 0
        logits = self.head(self.encoder(self.embedding(batch["input_ids"]), src_key_padding_mask=padding))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=BATCH, collate_fn=pad_tokens)


def longest_batch_peak() -> int:
    """The host allocator's peak of a training step on the 8 longest samples (57 to 64 tokens)."""
    data = Sequences()
    return steady_state_peak(pad_tokens([data[i] for i in range(len(data) - BATCH, len(data))]))


def steady_state_peak(batch: dict) -> int:
    """The host allocator's peak of a training step on ``batch``, the previous step's state alive."""
    model = TinyBert(Sequences())
    optimizer = model.configure_optimizers()

    def step() -> None:
        loss = model.training_step(batch, 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step(), step()
    return profiler_peak_bytes(step, existing=(model, optimizer, batch))


def test_the_estimate_traces_a_batch_of_the_longest_sample_and_names_its_length(tmp_path):
    estimator = MemoryEstimator(max_memory="200MB", measure_steps=1)
    quiet_trainer(tmp_path, [estimator], max_steps=1).fit(TinyBert(Sequences()))
    estimate = estimator.estimate
    longest, first = longest_batch_peak(), steady_state_peak(pad_tokens(Sequences().items[:BATCH]))
    print(f"\npredicted {estimate.predicted_peak_bytes}, longest batch {longest}, first batch {first}")
    assert first < 0.8 * longest  # tracing the first batch would miss by far more than the tolerance
    assert estimate.predicted_peak_bytes == pytest.approx(longest, rel=0.05)
    assert estimate.traced_batch.startswith("8 copies of the longest sample (per-sample shapes 64, 64, 64,")
    assert "the first batch's 8, 8, 8; of 72 samples, all)" in estimate.traced_batch
    # the line to the largest batch: a longest-length batch of the size it gives for 4 MB fills 4 MB
    largest = int((4e6 - estimate.fixed_bytes) // estimate.bytes_per_sample)
    assert steady_state_peak(pad_tokens([Sequences().items[-1]] * largest)) == pytest.approx(4e6, rel=0.05)


def test_looking_at_samples_that_draw_random_numbers_leaves_training_as_without_the_estimator(tmp_path):
    class Noisy(Sequences):
        def __getitem__(self, index: int) -> torch.Tensor:  # a random crop, as augmentations draw
            tokens = self.items[index]
            return tokens[int(torch.randint(0, 2, ())) :]

    def fit(callbacks: list) -> list[torch.Tensor]:
        torch.manual_seed(7)
        model = TinyBert(Noisy())
        quiet_trainer(tmp_path, callbacks, max_steps=3).fit(model)
        return [p.detach().clone() for p in model.parameters()]

    by_hand, estimator = fit([]), MemoryEstimator(measure_steps=1)
    assert all(torch.equal(a, b) for a, b in zip(fit([estimator]), by_hand))
    assert estimator.estimate.traced_batch.startswith("8 copies of the longest sample")


def test_on_a_stream_the_estimate_says_it_traced_the_first_batch_and_what_longer_ones_cost(tmp_path):
    class StreamBert(TinyBert):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(Stream(), batch_size=BATCH, collate_fn=pad_tokens)

    estimator = MemoryEstimator(measure_steps=1)
    quiet_trainer(tmp_path, [estimator], max_steps=1).fit(StreamBert(Sequences()))
    estimate = estimator.estimate
    assert estimate.traced_batch == "the first batch (per-sample shapes 8, 8, 8)"
    note = estimate.notes[-1]
    assert note.startswith("traced the first batch (per-sample shapes 8, 8, 8): the loader is a stream or batches")
    assert "; batches of longer samples need more memory than this estimate, about " in note
    per_step = round(estimate.bytes_per_sample / 8)
    assert f"about {per_step:,} bytes a sample per step of the length" in note


def test_gpuopt_estimate_traces_the_longest_sample_of_the_models_loader(capsys):
    assert cli.main(["estimate", f"{__file__}:TinyBert", "--max-memory", "200MB", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["setup"]["batch_source"] == "the model's train_dataloader()"
    assert estimate["traced_batch"].startswith("8 copies of the longest sample (per-sample shapes 64, 64, 64,")
    assert estimate["predicted_peak_bytes"] == pytest.approx(longest_batch_peak(), rel=0.05)
