"""Which batch the estimate traces (lightning_gpuopt.core.estimate.batch_to_trace), on real DataLoaders."""

from __future__ import annotations

import random

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_gpuopt.core.estimate import batch_to_trace
from lightning_gpuopt.core.loader import largest_samples_first


class Lengths(Dataset):
    """Token sequences of the given lengths; ``__getitem__`` draws from Python's RNG, as an augmentation would."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        random.random()
        return torch.ones(self.lengths[index], dtype=torch.long)


def pad(samples: list[torch.Tensor]) -> torch.Tensor:
    return pad_sequence(samples, batch_first=True)


def test_a_batch_of_copies_of_the_longest_sample_through_the_loaders_collate_fn():
    loader = DataLoader(Lengths([3] * 8 + [5, 11, 7]), batch_size=4, collate_fn=pad)
    first = next(iter(loader))
    batch, what, unseen = batch_to_trace(loader, first)
    assert batch.shape == (4, 11) and first.shape == (4, 3) and unseen is None
    assert what == "4 copies of the longest sample (per-sample shapes 11, the first batch's 3; of 11 samples, all)"


def test_the_first_batch_when_it_is_as_long_as_the_longest_or_the_samples_are_alike():
    padded = DataLoader(Lengths([9, 3, 5, 3]), batch_size=2, collate_fn=pad)
    first = next(iter(padded))
    assert batch_to_trace(padded, first) == (
        first,
        "the first batch (per-sample shapes 9), as long as the longest sample",
        None,
    )
    alike = DataLoader(TensorDataset(torch.zeros(16, 3), torch.zeros(16)), batch_size=4)
    first = next(iter(alike))
    batch, what, unseen = batch_to_trace(alike, first)
    assert batch is first and unseen is None
    assert what == "the first batch (per-sample shapes 3, 1); the samples looked at are alike"


def test_a_dataset_that_cannot_be_read_outside_the_loader_gives_the_first_batch_and_says_why():
    class Broken(Lengths):
        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 2:
                raise OSError("no file handle outside the workers")
            return super().__getitem__(index)

    loader = DataLoader(Broken([3, 3, 8, 3]), batch_size=2, collate_fn=pad)
    first = next(iter(loader))
    batch, what, unseen = batch_to_trace(loader, first)
    assert batch is first and what == "the first batch (per-sample shapes 3)"
    assert unseen == "its samples could not be looked at (OSError: no file handle outside the workers)"


def test_sample_sizes_of_a_plain_tensor_dataset_are_known_without_reading_a_sample(monkeypatch):
    # its rows are slices of the same tensors; a subclass may transform them, and is read as before
    reads = []
    monkeypatch.setattr(TensorDataset, "__getitem__", lambda self, index: reads.append(index) or torch.zeros(3))
    data = TensorDataset(torch.zeros(4096, 3))
    assert largest_samples_first(data) is None and reads == []

    class Rows(TensorDataset):
        pass

    assert largest_samples_first(Rows(torch.zeros(4096, 3))) is None and len(reads) == 4096
