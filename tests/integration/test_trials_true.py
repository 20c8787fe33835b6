"""Trials train what they promise, and the batch size found is the one training really uses.

Each found size is checked independently: a fresh model trains whole shuffled epochs at it under a
MemoryBudget of the same cap (held from train start, the model and optimizer counted), and the
smallest size the search saw miss runs out of memory the same way.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from helpers import quiet_trainer
from lightning import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from lightning_gpuopt import BatchSizeSearch, MemoryFill
from lightning_gpuopt.core.memory import MemoryBudget, is_out_of_memory_error


class BudgetAroundTraining(Callback):
    """The independent measurement: a MemoryBudget entered at train start, left at the end."""

    def __init__(self, cap: int) -> None:
        self.cap, self.budget = cap, None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.budget = MemoryBudget(self.cap, existing=(pl_module, *trainer.optimizers), device="cpu")
        self.budget.__enter__()

    def _leave(self) -> None:
        if self.budget is not None:
            budget, self.budget = self.budget, None
            budget.__exit__(None, None, None)

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self._leave()

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self._leave()


def make_trainer(tmp_path: Any, callbacks: list, **kwargs: Any) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, **{"max_steps": 1, **kwargs})


def trains_epochs(tmp_path: Any, model: LightningModule, cap: int, epochs: int = 2) -> bool:
    """Whole shuffled epochs of ``model`` under ``cap``: True, or False on an out-of-memory error."""
    try:
        make_trainer(tmp_path, [BudgetAroundTraining(cap)], max_steps=-1, max_epochs=epochs).fit(model)
    except Exception as error:
        if is_out_of_memory_error(error):
            return False
        raise
    return True


class Regressor(LightningModule):
    def __init__(self, batch_size: int = 16, samples: int = 300, width: int = 1024) -> None:
        super().__init__()
        self.batch_size, self.samples = batch_size, samples
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(self.samples, 64, generator=generator), torch.randn(self.samples, 1, generator=generator)
        )
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)


def smallest_miss(result: Any) -> Optional[int]:
    misses = [trial.batch_size for trial in result.trials if not trial.fits]
    return min(misses) if misses else None


def test_a_batch_above_half_the_data_is_tried_with_full_batches_at_every_step(tmp_path):
    # Adam doubles the parameters' memory at the first optimizer step: the trial's second step is the
    # one that counts, and with 300 samples a batch above 150 left it only the epoch's short remainder
    cap = 3_400_000
    search = BatchSizeSearch(max_memory=cap, margin=0.0, max_batch_size=300, verbose=False)
    make_trainer(tmp_path / "search", [search]).fit(Regressor())
    found = search.result.batch_size
    assert 150 < found < 300, search.result  # the case: above half of the samples, below all of them
    assert trains_epochs(tmp_path / "fits", Regressor(batch_size=found), cap)
    miss = smallest_miss(search.result)
    assert miss is not None and not trains_epochs(tmp_path / "misses", Regressor(batch_size=miss), cap)


class Sequences(torch.utils.data.Dataset):
    """Token sequences of 8, except ``long_count`` of 256 (rare long samples)."""

    def __init__(self, count: int = 4096, long_count: int = 4) -> None:
        generator = torch.Generator().manual_seed(0)
        long_at = set(torch.randperm(count, generator=generator)[:long_count].tolist())
        self.items = [
            torch.randint(0, 100, (256 if index in long_at else 8,), generator=generator) for index in range(count)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def pad(batch: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(batch, batch_first=True)


class TokenModel(LightningModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.embed = nn.Embedding(100, 64)
        self.mix = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 100))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.mix(self.embed(batch))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Sequences(), batch_size=self.batch_size, shuffle=True, collate_fn=pad)


def test_four_long_samples_in_4096_decide_the_batch(tmp_path):
    cap = 12_000_000
    search = BatchSizeSearch(max_memory=cap, margin=0.0, verbose=False)
    make_trainer(tmp_path / "search", [search]).fit(TokenModel())
    assert any(
        "sample sizes vary (8 to 256 elements over 4,096 of 4,096 samples" in note for note in search.result.notes
    )
    found = search.result.batch_size
    # a whole shuffled epoch holds all four long samples, each padding its batch to 256 tokens
    assert trains_epochs(tmp_path / "fits", TokenModel(batch_size=found), cap, epochs=1)
    miss = smallest_miss(search.result)
    assert miss is not None and not trains_epochs(tmp_path / "misses", TokenModel(batch_size=miss), cap, epochs=1)


#: kept outside the module: the search puts the module's own attributes back after its trials
TRIAL_GENERATOR_STEPS: list[bool] = []


class TwoOptimizers(LightningModule):
    """A GAN-shaped module: manual optimization, a generator and a critic, each with its Adam; the
    generator steps every third batch, so its optimizer state exists only from the third batch on."""

    def __init__(self, batch_size: int = 8, samples: int = 2048) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size, self.samples = batch_size, samples
        self.search: Optional[BatchSizeSearch] = None
        self.generator = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 64))
        self.critic = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        g_opt, c_opt = self.optimizers()
        noise = torch.randn(real.shape[0], 32, generator=torch.Generator().manual_seed(batch_idx))
        fake = self.generator(noise)
        c_loss = self.critic(fake.detach()).mean() - self.critic(real).mean()
        c_opt.zero_grad()
        self.manual_backward(c_loss)
        c_opt.step()
        if batch_idx % 3 == 2:  # the generator learns every third batch (a WGAN's n_critic)
            if self.search is not None and self.search.result is None:  # a trial: was the state already there?
                TRIAL_GENERATOR_STEPS.append(len(g_opt.optimizer.state) > 0)
            g_loss = -self.critic(fake).mean()
            g_opt.zero_grad()
            self.manual_backward(g_loss)
            g_opt.step()

    def configure_optimizers(self) -> list:
        return [torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.critic.parameters())]

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.randn(self.samples, 64, generator=torch.Generator().manual_seed(0)))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)


def test_manual_optimization_with_two_optimizers_trials_run_the_batches_they_promise(tmp_path):
    cap = 2_500_000
    search = BatchSizeSearch(max_memory=cap, margin=0.0, verbose=False)
    model = TwoOptimizers()
    model.search = search
    TRIAL_GENERATOR_STEPS.clear()
    make_trainer(tmp_path / "search", [search]).fit(model)
    # every trial that fitted ran a generator step with the generator's optimizer state in place (the
    # step training's peak comes from); a 2-"step" trial counted by global_step ran none
    fitted = sum(trial.fits for trial in search.result.trials)
    assert sum(TRIAL_GENERATOR_STEPS) >= fitted >= 1
    found = search.result.batch_size
    assert trains_epochs(tmp_path / "fits", TwoOptimizers(batch_size=found), cap, epochs=1)
    miss = smallest_miss(search.result)
    assert miss is not None and not trains_epochs(tmp_path / "misses", TwoOptimizers(batch_size=miss), cap, epochs=1)


class FixedBatchLoader(Regressor):
    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.randn(self.samples, 64), torch.randn(self.samples, 1))
        return DataLoader(data, batch_size=32, shuffle=True)  # ignores self.batch_size


def test_a_loader_that_ignores_the_batch_size_is_named(tmp_path):
    search = BatchSizeSearch(max_memory=50_000_000, verbose=False)
    with pytest.raises(
        MisconfigurationException, match=r"batches of \[32\] samples: FixedBatchLoader.train_dataloader\(\)"
    ):
        make_trainer(tmp_path, [search]).fit(FixedBatchLoader(samples=2048))
    fill = MemoryFill(max_memory=50_000_000, global_batch_size=256, verbose=False)
    with pytest.raises(MisconfigurationException, match="does not build its loader with that batch size"):
        make_trainer(tmp_path, [fill]).fit(FixedBatchLoader(samples=2048))


class OwnBatchSampler(BatchSampler):
    pass


class BatchSamplerLoader(Regressor):
    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.randn(self.samples, 64), torch.randn(self.samples, 1))
        return DataLoader(data, batch_sampler=OwnBatchSampler(RandomSampler(data), 64, drop_last=False))


def test_a_loader_whose_batch_sampler_decides_the_size_is_refused(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"`batch_sampler` \(OwnBatchSampler\), which decides"):
        make_trainer(tmp_path, [BatchSizeSearch(max_memory=50_000_000, verbose=False)]).fit(
            BatchSamplerLoader(samples=2048)
        )


class InOrder(Regressor):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            TensorDataset(torch.randn(self.samples, 64), torch.randn(self.samples, 1)), batch_size=self.batch_size
        )


def test_an_empty_dataset_is_refused(tmp_path):
    with pytest.raises(MisconfigurationException, match="holds no samples"):
        make_trainer(tmp_path, [BatchSizeSearch(max_memory=50_000_000, verbose=False)]).fit(InOrder(samples=0))


def test_a_global_batch_larger_than_the_data_is_refused(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"holds 5 per device: every step would see 5.*at most 5"):
        make_trainer(tmp_path, [MemoryFill(max_memory=50_000_000, global_batch_size=64, verbose=False)]).fit(
            Regressor(samples=5)
        )


class TwoPlaces(Regressor):
    """``batch_size`` on the model (16) and in its hparams (32); the loader reads the hparams."""

    def __init__(self) -> None:
        super().__init__(batch_size=16, samples=2048)
        self.save_hyperparameters({"batch_size": 32})

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.randn(self.samples, 64), torch.randn(self.samples, 1))
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True)


def test_batch_size_in_two_places_warns_sets_both_and_puts_both_back_on_failure(tmp_path):
    model = TwoPlaces()
    search = BatchSizeSearch(max_memory=50_000_000, verbose=False)
    with pytest.warns(
        UserWarning,
        match=r"several places with different values \(`model.batch_size`=16, `hparams.batch_size`=32\); the train loader uses 32",
    ):
        make_trainer(tmp_path / "ok", [search]).fit(model)
    assert search.result.initial_batch_size == 32
    assert model.batch_size == model.hparams.batch_size == search.result.batch_size
    model = TwoPlaces()
    with pytest.raises(Exception, match="does not fit"), pytest.warns(UserWarning):
        make_trainer(tmp_path / "none", [BatchSizeSearch(max_memory=2_000, verbose=False)]).fit(model)
    assert (model.batch_size, model.hparams.batch_size) == (16, 32)  # each as it was


class DataModuleRegressor(LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(512, 64), torch.randn(512, 1)), batch_size=7)


def test_a_datamodule_loader_that_ignores_the_batch_size_is_named(tmp_path):
    class NoLoader(Regressor):
        train_dataloader = None  # type: ignore[assignment]

    with pytest.raises(MisconfigurationException, match=r"DataModuleRegressor.train_dataloader\(\) does not build"):
        make_trainer(tmp_path, [BatchSizeSearch(max_memory=50_000_000, verbose=False)]).fit(
            NoLoader(), datamodule=DataModuleRegressor()
        )
