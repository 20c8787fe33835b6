"""BatchSizeSearch with a real Trainer on CPU, under simulated budgets (MemoryBudget).

Every result is checked by an independent measurement: a fresh model and Trainer run the same
number of real training steps at that size inside a fresh ``MemoryBudget`` with the same cap.
"""

from __future__ import annotations

import gc
import json
import math
import re
from typing import Any, Optional

import pytest
import torch
from helpers import BudgetAroundTraining, fits_independently, quiet_trainer
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models_memory import make_model
from torch import nn
from torch.utils.data import DataLoader

from lightning_gpuopt.callbacks._reporting import report_dir
from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch, NoBatchSizeFitsError
from lightning_gpuopt.core.memory import is_out_of_memory_error
from lightning_gpuopt.core.report import format_bytes

BUDGET = "20MB"
SAMPLES = 4096


def trainer_for(tmp_path, callbacks, max_steps: int = 1, **kwargs: Any) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, max_steps=max_steps, **kwargs)


def search(tmp_path, name: str, samples: int = SAMPLES, max_steps: int = 1, **kwargs: Any):
    kwargs.setdefault("max_memory", BUDGET)
    kwargs.setdefault("margin", 0.1)  # the flat margin; the default, measured headroom is tested on its own
    initial = kwargs.pop("initial", 16)
    searcher = BatchSizeSearch(**kwargs)
    model = make_model(name, num_samples=samples, batch_size=initial)
    trainer = trainer_for(tmp_path, [searcher], max_steps=max_steps)
    trainer.fit(model)
    return searcher, model, trainer


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_result_is_the_largest_batch_that_fits_checked_independently(tmp_path, name):
    searcher, model, trainer = search(tmp_path, name)
    result = searcher.result
    assert result is not None and result.batch_size is not None
    assert model.batch_size == result.batch_size  # set where train_dataloader() reads it
    assert trainer.train_dataloader.batch_size == result.batch_size  # training used it
    assert len(result.trials) <= 8
    assert result.budget_bytes == int(20_000_000 * 0.9)
    chosen = [t for t in result.trials if t.batch_size == result.batch_size]
    assert chosen and all(t.fits and t.peak_bytes <= result.budget_bytes for t in chosen)
    assert fits_independently(tmp_path, name, result.batch_size, result.budget_bytes)
    assert not fits_independently(tmp_path, name, result.batch_size + 1, result.budget_bytes)


def test_the_default_headroom_lands_within_5_percent_of_the_largest_fit_and_fits(tmp_path):
    result = search(tmp_path, "mlp", margin="auto", max_memory=10_000_000)[0].result
    assert result.budget_bytes == 10_000_000 and fits_independently(tmp_path, "mlp", result.batch_size, 10_000_000)
    assert not fits_independently(tmp_path, "mlp", math.ceil(result.batch_size / 0.95), 10_000_000)


def test_trials_set_the_objects_alive_aside_from_the_collector_and_training_gets_them_back(tmp_path):
    """A failed trial's full collection then scans the trials' objects only (see ``objects_set_aside``)."""
    model, frozen = make_model("mlp", num_samples=SAMPLES, batch_size=16), []
    step = model.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        frozen.append(gc.get_freeze_count() > 0)
        return step(batch, batch_idx)

    model.training_step = training_step
    searcher = BatchSizeSearch(max_memory=BUDGET, verbose=False)
    trainer_for(tmp_path, [searcher], max_steps=2).fit(model)
    assert any(not trial.fits for trial in searcher.result.trials)  # a trial ran out of memory under the freeze
    assert frozen[:-2] == [True] * (len(frozen) - 2) and frozen[-2:] == [False, False]  # training: as before
    assert gc.get_freeze_count() == 0


def test_multiple_of_eight(tmp_path):
    searcher, _, _ = search(tmp_path, "mlp", multiple_of=8)
    size = searcher.result.batch_size
    assert size % 8 == 0 and all(t.batch_size % 8 == 0 for t in searcher.result.trials)
    assert fits_independently(tmp_path, "mlp", size, searcher.result.budget_bytes)
    assert not fits_independently(tmp_path, "mlp", size + 8, searcher.result.budget_bytes)


def test_cap_mode_never_goes_above_the_users_batch(tmp_path):
    searcher, model, _ = search(tmp_path, "mlp", mode="cap", initial=48)
    assert searcher.result.batch_size == 48 == model.batch_size
    assert [t.batch_size for t in searcher.result.trials] == [48]
    assert searcher.result.stop_reason == "upper bound"


def test_dataset_smaller_than_the_limit_returns_its_length(tmp_path):
    searcher, _, _ = search(tmp_path, "mlp", samples=300)
    result = searcher.result
    assert result.batch_size == 300 and result.stop_reason == "upper bound"
    assert any(t.batch_size == 300 and t.fits for t in result.trials)
    assert all(t.batch_size <= 300 for t in result.trials)


def test_budget_too_small_for_min_batch_size_says_what_to_try(tmp_path):
    with pytest.raises(NoBatchSizeFitsError) as info:
        search(tmp_path, "mlp", max_memory="3MB", margin=0.0)  # parameters + Adam state alone are ~6 MB
    message = str(info.value)
    assert "min_batch_size=1" in message and "3000000 bytes" in message  # the budget
    assert "ran out of memory" in message and "MemoryFill" in message and "smaller model" in message


def test_nothing_fits_message_gives_the_failed_trials_own_figures(tmp_path):
    # budget 2.7 MB: the trial at 1 runs out of memory inside the step (parameters, gradients and
    # Adam state need ~6.4 MB), its recorded peak below the budget -- the message must say so
    with pytest.raises(NoBatchSizeFitsError) as info:
        search(tmp_path, "mlp", max_memory="3MB")
    result = info.value.result
    assert result is not None and result.batch_size is None and result.stop_reason == "nothing fits"
    trial = min(result.trials, key=lambda t: t.batch_size)
    assert trial.batch_size == 1 and not trial.fits and trial.peak_bytes < result.budget_bytes == 2_700_000
    message = str(info.value)
    assert "even min_batch_size=1 does not fit" in message
    # why it failed, in the trial's own figures: out of memory under the cap, its recorded peak
    assert (
        f"ran out of memory inside a training step, its peak until then {format_bytes(trial.peak_bytes)} "
        f"({trial.peak_bytes} bytes) under the cap of {format_bytes(result.budget_bytes)} "
        f"({result.budget_bytes} bytes)"
    ) in message
    allocated, live, cap = map(
        int,
        re.search(r"tried to allocate (\d+) bytes with (\d+) bytes live and a cap of (\d+) bytes", message).groups(),
    )
    assert cap == result.budget_bytes and live <= trial.peak_bytes < cap < live + allocated
    needs = int(re.search(r"needs [^(]*\((\d+) bytes\)", message).group(1))  # measured again without the cap
    assert needs > cap
    # no figure in the message contradicts the trial: every byte count is one of these
    assert set(map(int, re.findall(r"(\d+) bytes", message))) == {trial.peak_bytes, cap, allocated, live, needs}


def test_max_trials_spent_without_a_fit_does_not_claim_min_batch_size_fails(tmp_path):
    with pytest.warns(UserWarning, match="could not be traced"), pytest.raises(NoBatchSizeFitsError) as info:
        search(tmp_path, "data-dependent", max_memory="2MB", max_trials=1, initial=SAMPLES)
    result = info.value.result
    assert [(t.batch_size, t.fits) for t in result.trials] == [(SAMPLES, False)]
    assert result.stop_reason == "max trials"
    message = str(info.value)
    assert "min_batch_size=1 does not fit" not in message  # 1 was never tried (and it fits)
    assert f"no size fitted in 1 trial (max_trials=1); the smallest tried, {SAMPLES}, does not fit" in message


class StateBefore(Callback):
    """Gives the optimizer and scheduler state (one real step), then snapshots everything."""

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        x, y = next(iter(pl_module.loader(8)))
        torch.nn.functional.cross_entropy(pl_module(x), y).backward()
        trainer.optimizers[0].step()
        trainer.lr_scheduler_configs[0].scheduler.step()
        self.tensors = {k: v.clone() for k, v in pl_module.state_dict(keep_vars=False).items()}
        self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters()}
        self.optimizer = _clone_tree(trainer.optimizers[0].state_dict())
        self.scheduler = _clone_tree(trainer.lr_scheduler_configs[0].scheduler.state_dict())
        self.counters = (trainer.global_step, trainer.current_epoch, trainer.fit_loop.epoch_loop._batches_that_stepped)
        self.rng = torch.get_rng_state()
        self.training = [m.training for m in pl_module.modules()]


class StateAfter(Callback):
    def __init__(self, before: StateBefore) -> None:
        self.before = before
        self.checked = False

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        before = self.before
        now = pl_module.state_dict()
        assert now.keys() == before.tensors.keys()
        assert all(torch.equal(now[k], before.tensors[k]) for k in now)  # BatchNorm statistics included
        assert all(torch.equal(p.grad, before.grads[n]) for n, p in pl_module.named_parameters())
        # the batch changed: the optimizer and its schedule were built again by configure_optimizers (a
        # schedule sized with estimated_stepping_batches must count the new steps), fresh as a run by hand has them
        assert not trainer.optimizers[0].state_dict()["state"]
        assert trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"] == 0
        assert (
            trainer.global_step,
            trainer.current_epoch,
            trainer.fit_loop.epoch_loop._batches_that_stepped,
        ) == before.counters
        assert torch.equal(torch.get_rng_state(), before.rng)
        assert [m.training for m in pl_module.modules()] == before.training
        assert not trainer.callback_metrics  # no trial step logged anything
        self.checked = True


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tree(v) for v in tree)
    return tree


def _assert_equal_trees(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal_trees(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal_trees(x, y)
    else:
        assert a == b


class RecordingLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[dict, Optional[int]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        self.calls.append((dict(metrics), step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_state_is_restored_bit_for_bit_and_loggers_see_no_trial(tmp_path):
    model = make_model("cnn", num_samples=SAMPLES, batch_size=16)  # BatchNorm: running statistics change in trials
    original_configure = model.configure_optimizers

    def configure_optimizers():
        optimizer = original_configure()
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    model.configure_optimizers = configure_optimizers
    original_step, steps = model.training_step, []  # calls on real tensors (the estimate's traces: fake ones)

    def training_step(batch: Any, batch_idx: int) -> Any:
        steps.extend([] if hasattr(batch[0], "fake_mode") else [batch_idx])
        return original_step(batch, batch_idx)

    model.training_step = training_step
    before = StateBefore()
    after = StateAfter(before)
    searcher = BatchSizeSearch(max_memory=BUDGET)
    logger = RecordingLogger()
    trainer = trainer_for(
        tmp_path, [before, searcher, after], max_steps=2, logger=logger, log_every_n_steps=1, enable_checkpointing=True
    )
    trainer.fit(model)
    assert after.checked and len(searcher.result.trials) >= 2
    assert trainer.global_step == 2  # training ran its own 2 steps after the search
    train_steps = [step for metrics, step in logger.calls if "train_loss" in metrics]
    assert train_steps == [0, 1]  # the trials' steps were never logged
    logged = [metrics for metrics, _ in logger.calls if "gpuopt/batch_size" in metrics]
    assert len(logged) == 1 and logged[0]["gpuopt/batch_size"] == searcher.result.batch_size
    assert logged[0]["gpuopt/batch_search_trials"] == len(searcher.result.trials)
    # the steps the trials ran (one that ran out of memory: fewer), not trials x steps_per_trial: every call but
    # the estimate's first trace (on the host's batch) and training's 2 steps
    assert logged[0]["gpuopt/batch_search_steps"] == len(steps) - 1 - 2 == searcher.result.steps
    # no checkpoint of the search remains; the only one is training's own (enable_checkpointing=True)
    checkpoints = sorted(p.name for p in tmp_path.rglob("*.ckpt"))
    assert all(not name.startswith(".") and "scale_batch" not in name for name in checkpoints)
    assert len(checkpoints) == 1
    report = json.loads((report_dir(trainer) / "gpuopt_report.json").read_text())
    assert report["batch_size_search"]["batch_size"] == searcher.result.batch_size


def test_report_section_and_table(tmp_path, caplog):
    with caplog.at_level("INFO"):
        searcher, _, _ = search(tmp_path, "mlp")
    section = json.loads((tmp_path / "gpuopt_report.json").read_text())["batch_size_search"]
    assert section["batch_size"] == searcher.result.batch_size
    assert [t["batch_size"] for t in section["trials"]] == [t.batch_size for t in searcher.result.trials]
    assert "BatchSizeSearch" in caplog.text and "CHOSEN" in caplog.text
    # the memory limit as given (20 MB) and the budget, the limit less the margin, each under one name
    result = searcher.result
    assert (section["limit_bytes"], section["budget_bytes"]) == (20_000_000, 18_000_000)
    table = {row[0].strip(): row[1].strip() for row in re.findall(r"^│ ([^│]+)│ ([^│]+)│$", caplog.text, re.M)}
    assert table["memory limit"] == "19.1 MiB (20 MB) per rank, 1 rank(s)" and "capacity" not in table
    assert table["budget"] == f"{format_bytes(18_000_000)} (the memory limit less margin)"
    fitted = max(t.batch_size for t in result.trials if t.fits)
    assert (
        table["largest batch: predicted / trained"] == f"{result.predicted_batch_size} (estimate) / {fitted} (trials)"
    )
    assert table["batch size"] == f"16 → {result.batch_size}"
    # the batch grew: the learning rate was kept, and the report says what each rule would set
    grown, lr = result.batch_size / 16, 1e-3
    note = f"the global batch is {grown:.4g}x yours, lr kept at {lr:.4g}: the linear rule would set {lr * grown:.4g}"
    assert note in result.notes[-1] and result.notes[-1] in caplog.text.replace("\n    ", " ")


def test_missing_batch_size_attribute_explains_how_to_expose_it(tmp_path):
    model = make_model("mlp")
    del model.batch_size
    with pytest.raises(MisconfigurationException, match=r"self\.batch_size = batch_size"):
        trainer_for(tmp_path, [BatchSizeSearch(max_memory=BUDGET)]).fit(model)


def test_loader_passed_to_fit_cannot_be_resized(tmp_path):
    model = make_model("mlp")
    with pytest.raises(MisconfigurationException, match="train_dataloader"):
        trainer_for(tmp_path, [BatchSizeSearch(max_memory=BUDGET)]).fit(model, model.loader(8))


def test_cpu_without_max_memory_is_a_clear_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"`max_memory`=None on a cpu device"):
        trainer_for(tmp_path, [BatchSizeSearch()]).fit(make_model("mlp"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_memory="lots"), r"`max_memory`='lots' is not a memory size"),
        (dict(margin=1.0), r"`margin` must be a number in \[0, 1\), got 1.0"),
        (dict(steps_per_trial=0), r"`steps_per_trial` must be an integer >= 1, got 0; e.g. steps_per_trial=2"),
        (dict(max_trials=2.5), r"`max_trials` must be an integer >= 1, got 2.5"),
        (dict(min_batch_size=0), r"`min_batch_size` must be an integer >= 1, got 0"),
        (dict(min_batch_size=64, max_batch_size=32), r"`max_batch_size` must be an integer >= 64, got 32"),
        (dict(multiple_of=0), r"`multiple_of` must be an integer >= 1, got 0"),
        (dict(multiple_of=64, max_batch_size=32), r"`multiple_of`=64 is above `max_batch_size`=32"),
        (dict(batch_arg_name=""), r"`batch_arg_name` must be a non-empty name \(a str\), got ''"),
        (dict(mode="power"), r"`mode` must be one of 'fill', 'cap', got 'power'"),
    ],
)
def test_bad_arguments_name_the_argument_the_value_and_what_works(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchSizeSearch(**kwargs)


def test_a_step_that_cannot_be_traced_starts_at_the_users_batch_and_still_finds_the_limit(tmp_path):
    with pytest.warns(UserWarning, match="could not be traced"):
        searcher, _, _ = search(tmp_path, "data-dependent", max_memory="2MB")
    result = searcher.result
    assert result.start_batch_size == 16 and result.predicted_batch_size is None
    assert len(result.trials) <= 8
    assert fits_independently(tmp_path, "data-dependent", result.batch_size, result.budget_bytes)
    assert not fits_independently(tmp_path, "data-dependent", result.batch_size + 1, result.budget_bytes)


class VariableLengthTokens(torch.utils.data.Dataset):
    """Token sequences of 8 to 256 tokens; :func:`pad_batch` pads each batch to its longest."""

    def __init__(self, size: int = 384) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [(torch.randint(1, 1000, (8 + (i * 37) % 249,), generator=generator), i % 10) for i in range(size)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.items[index]


def pad_batch(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.nn.utils.rnn.pad_sequence([tokens for tokens, _ in batch], batch_first=True)
    return tokens, torch.tensor([label for _, label in batch])


class SequenceClassifier(LightningModule):
    def __init__(self, batch_size: int = 8, longest_second: bool = False) -> None:
        super().__init__()
        self.batch_size, self.longest_second = batch_size, longest_second
        self.embed = nn.Embedding(1000, 32)
        self.head = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
        self.data = VariableLengthTokens()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return nn.functional.cross_entropy(self.head(self.embed(tokens)).mean(1), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        if self.longest_second:
            # the worst case, built independently of the callback: the longest sequences in the
            # second step, when Adam's state exists
            by_length = sorted(range(len(self.data)), key=lambda i: len(self.data.items[i][0]))
            order = by_length[: self.batch_size] + by_length[-self.batch_size :]
            return DataLoader(self.data, batch_size=self.batch_size, sampler=order, collate_fn=pad_batch)
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, collate_fn=pad_batch)


def fits_sequences(tmp_path, cap_bytes: int, **kwargs: Any) -> bool:
    trainer = trainer_for(
        tmp_path, [BudgetAroundTraining(cap_bytes)], max_steps=kwargs.pop("max_steps", -1), max_epochs=1
    )
    try:
        trainer.fit(SequenceClassifier(**kwargs))
    except Exception as error:
        if is_out_of_memory_error(error):
            return False
        raise
    return True


def test_varying_lengths_the_size_found_fits_the_longest_batch_of_a_whole_epoch(tmp_path):
    searcher = BatchSizeSearch(max_memory=BUDGET, margin=0.1)  # a flat margin: the limit of its budget, exactly
    trainer_for(tmp_path, [searcher], max_steps=1).fit(SequenceClassifier())
    result = searcher.result
    assert any("batches of the largest sample" in note for note in result.notes), result.notes
    found, cap = result.batch_size, result.budget_bytes
    # a whole shuffled epoch at that size fits, its longest batch included ...
    assert fits_sequences(tmp_path / "epoch", cap, batch_size=found)
    # ... and it is the limit: one more sample does not fit when the longest sequences come in a
    # step where the optimizer state exists
    assert fits_sequences(tmp_path / "worst-found", cap, batch_size=found, longest_second=True, max_steps=2)
    assert not fits_sequences(tmp_path / "worst", cap, batch_size=found + 1, longest_second=True, max_steps=2)
