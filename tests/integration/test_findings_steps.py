"""DataWaitMonitor's findings inside training steps, ``graph-kept`` and ``host-sync``, on a real
Trainer: a module with the pattern (found, with its numbers) and one without it (no finding)."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from helpers import MLP, preloaded_dataset, quiet_trainer
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_gpuopt import DataWaitMonitor
from lightning_gpuopt.callbacks._detectors import GRAPH_STEPS, SYNC_STEPS, HostSyncProbe, KeptGraphProbe
from lightning_gpuopt.core.findings import graph_kept, host_sync
from lightning_gpuopt.testing import SimulatedGpu


def fit(tmp_path, model, max_steps: int = 8, **kwargs) -> DataWaitMonitor:
    monitor = DataWaitMonitor(warmup_steps=3, verbose=False)
    quiet_trainer(tmp_path, [monitor], max_steps=max_steps, **kwargs).fit(
        model, DataLoader(preloaded_dataset(256, 32), batch_size=16)
    )
    return monitor


def found(monitor: DataWaitMonitor, kind: str):
    matches = [finding for finding in monitor.report.findings if finding.kind == kind]
    assert len(matches) <= 1
    return matches[0] if matches else None


def probe(monitor: DataWaitMonitor, probe_type):
    (match,) = [item for item in monitor._probes if isinstance(item, probe_type)]
    return match


def line_of(function, marker: str) -> str:
    """``file:line`` of the line of ``function``'s source that holds ``marker``."""
    lines, first = inspect.getsourcelines(function)
    (offset,) = [i for i, text in enumerate(lines) if marker in text]
    return f"{inspect.getsourcefile(function)}:{first + offset}"


def reachable_nodes(tensor: torch.Tensor) -> int:
    """The test's own count of the autograd nodes behind ``tensor`` (breadth first)."""
    seen, frontier = set(), [tensor.grad_fn]
    while frontier:
        frontier = [node for node in frontier if node is not None and node not in seen]
        seen.update(frontier)
        frontier = [nxt for node in frontier for nxt, _ in node.next_functions]
    return len(seen)


# ----------------------------------------------------------------------------- graph-kept


class SumsLoss(MLP):
    """The classic bug: ``self.total_loss += loss`` keeps every step's graph. ``detach``: the fix."""

    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        self.detach = detach
        self.total_loss = 0.0
        self.nodes_at_start: dict[int, int] = {}

    def on_train_batch_start(self, batch, batch_idx):
        if isinstance(self.total_loss, torch.Tensor) and self.total_loss.grad_fn is not None:
            self.nodes_at_start[self.global_step] = reachable_nodes(self.total_loss)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.total_loss += loss.detach() if self.detach else loss
        return loss


class KeepsOutputs(MLP):
    """``self.outputs.append(loss)`` in a submodule-free list attribute; ``last_loss`` holds one step's graph only."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.outputs.append(loss)
        return loss


class KeepsLastLoss(MLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss  # one step's graph, replaced every step: it does not grow
        return loss


@pytest.mark.parametrize("simulated", [False, True], ids=["host", "simulated-A100"])
def test_an_accumulated_loss_keeps_a_growing_graph_and_is_named(tmp_path, simulated):
    model = SumsLoss()
    if simulated:
        with SimulatedGpu("A100", memory="1GiB"):
            monitor = fit(tmp_path, model, max_steps=10)
    else:
        monitor = fit(tmp_path, model, max_steps=10)
    finding = found(monitor, "graph-kept")
    assert finding is not None and finding.where == "total_loss"
    assert "`total_loss`" in finding.message
    assert "self.total_loss += loss.detach()" in finding.fix
    # the graph sizes at the sampled step starts (2, 4, 8, then after the last step) are the
    # test's own breadth-first count of the same graph (global_step == step index here)
    sampled = [step for step in GRAPH_STEPS if step < 10]
    expected = [model.nodes_at_start[step] for step in sampled] + [reachable_nodes(model.total_loss)]
    assert expected == sorted(expected) and expected[0] < expected[-1]
    shown = " → ".join(map(str, expected))
    assert f"{shown} autograd nodes at the starts of steps {', '.join(map(str, [*sampled, 10]))}" in finding.message
    assert finding.figures["graph_nodes"] == expected[-1]
    assert finding.figures["graph_nodes_per_step"] == (expected[-1] - expected[0]) / (10 - sampled[0])
    assert ("memory_growth_bytes" in finding.figures) is simulated  # the host cannot tell live memory


def test_a_list_of_losses_is_found_with_the_append_fix(tmp_path):
    monitor = fit(tmp_path, KeepsOutputs())
    finding = found(monitor, "graph-kept")
    assert finding is not None and finding.where == "outputs"
    assert "self.outputs.append(loss.detach())" in finding.fix
    assert finding.figures["attributes"] == 1.0


def test_detached_or_replaced_losses_keep_no_growing_graph(tmp_path):
    detached = fit(tmp_path, SumsLoss(detach=True))
    last = fit(tmp_path, KeepsLastLoss())
    plain = fit(tmp_path, MLP())
    assert found(detached, "graph-kept") is None and found(last, "graph-kept") is None
    assert found(plain, "graph-kept") is None
    # the replaced loss was seen holding a graph, of the same size at every sampled step
    sizes = {sample["last_loss"] for sample in probe(last, KeptGraphProbe)._nodes}
    assert len(sizes) == 1 and sizes.pop() > 0


def test_graph_kept_decides_on_growth_at_two_sampled_steps_or_more():
    assert graph_kept([2], {"total": [9]}) is None
    assert graph_kept([2, 4], {"total": [0, 9]}) is None  # held once
    finding = graph_kept([2, 4, 8], {"total": [9, 17, 33], "cache": [5, 5, 5]}, [100, 200, 400])
    assert finding.where == "total" and finding.figures["memory_growth_bytes"] == 300.0
    assert finding.figures["graph_nodes_per_step"] == 4.0


# ----------------------------------------------------------------------------- host-sync


class ReadsLoss(MLP):
    """``reads`` host reads of the loss per training step, by construction: ``.item()`` calls,
    ``if loss > 0:`` and ``float(loss)``."""

    def __init__(self, items: int = 0, compare: bool = False, converts: bool = False) -> None:
        super().__init__()
        self.items, self.compare, self.converts = items, compare, converts

    @property
    def reads(self) -> int:
        return self.items + int(self.compare) + int(self.converts)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.after_loss(loss)
        return loss

    def after_loss(self, loss):
        for _ in range(self.items):
            loss.item()  # marker: item
        if self.compare and loss > 0:  # marker: compare
            pass
        if self.converts:
            self.last_value = float(loss)  # marker: float


def host_sync_run(tmp_path, model, **kwargs):
    with SimulatedGpu("A100", memory="1GiB"):
        monitor = fit(tmp_path, model, **kwargs)
    counts = probe(monitor, HostSyncProbe).counts
    assert [step for step, _, _ in counts] == list(SYNC_STEPS)
    return monitor, counts


def baseline_syncs(tmp_path, model, **kwargs) -> float:
    """The reads per step a module without any read of its own has (Lightning's), on the same settings."""
    monitor, counts = host_sync_run(tmp_path, model, **kwargs)
    assert found(monitor, "host-sync") is None
    assert all(user == 0 for _, user, _ in counts)
    return sum(lightning for _, _, lightning in counts) / len(counts)


def test_item_and_comparisons_on_the_loss_are_counted_per_step_with_their_lines(tmp_path):
    baseline = baseline_syncs(tmp_path, MLP())
    model = ReadsLoss(items=2, compare=True)
    monitor, _ = host_sync_run(tmp_path, model)
    finding = found(monitor, "host-sync")
    assert finding is not None
    assert finding.figures["user_syncs_per_step"] == model.reads == 3
    assert finding.figures["syncs_per_step"] == model.reads + baseline
    item, compare = line_of(ReadsLoss.after_loss, "marker: item"), line_of(ReadsLoss.after_loss, "marker: compare")
    assert set(finding.where.split(", ")) == {item, compare}
    assert f"{item} (2/step)" in finding.message and f"{compare} (1/step)" in finding.message
    assert item in finding.fix and "self.log(name, value, on_step=True)" in finding.fix


def test_float_of_the_loss_is_a_host_sync(tmp_path):
    monitor, _ = host_sync_run(tmp_path, ReadsLoss(converts=True))
    finding = found(monitor, "host-sync")
    assert finding is not None and finding.figures["user_syncs_per_step"] == 1
    assert finding.where == line_of(ReadsLoss.after_loss, "marker: float")


def test_a_plain_module_with_step_logging_progress_bar_and_logger_has_no_host_sync(tmp_path):
    class Logs(MLP):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, on_step=True, prog_bar=True)
            return loss

    baseline_syncs(tmp_path, Logs(), enable_progress_bar=True, logger=True, log_every_n_steps=1)


def test_a_host_run_counts_no_host_sync(tmp_path):
    """On the CPU nothing waits for a card: ``.item()`` is no finding (see _detectors)."""
    monitor = fit(tmp_path, ReadsLoss(items=2))
    assert found(monitor, "host-sync") is None
    assert probe(monitor, HostSyncProbe).counts == []


def test_host_sync_under_bf16_mixed_precision(tmp_path):
    baseline = baseline_syncs(tmp_path, MLP(), precision="bf16-mixed")
    monitor, _ = host_sync_run(tmp_path, ReadsLoss(items=1), precision="bf16-mixed")
    finding = found(monitor, "host-sync")
    assert finding is not None and finding.figures["syncs_per_step"] == 1 + baseline


class ManualSteps(ReadsLoss):
    def __init__(self, items: int = 0) -> None:
        super().__init__(items=items)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.manual_backward(loss)
        optimizer.step()
        self.after_loss(loss)
        return loss


def test_host_sync_under_manual_optimization(tmp_path):
    baseline = baseline_syncs(tmp_path, ManualSteps())
    monitor, _ = host_sync_run(tmp_path, ManualSteps(items=2))
    finding = found(monitor, "host-sync")
    assert finding is not None and finding.figures["syncs_per_step"] == 2 + baseline
    assert finding.figures["user_syncs_per_step"] == 2


class Checkpointed(ReadsLoss):
    """The hidden block under activation checkpointing (recomputed in backward)."""

    def forward(self, x):
        hidden = checkpoint(self.net[:-1], x, use_reentrant=False)
        return self.net[-1](hidden)


def test_host_sync_composes_with_activation_checkpointing(tmp_path):
    torch.manual_seed(0)
    plain = Checkpointed()
    reference = Checkpointed()
    reference.load_state_dict(plain.state_dict())
    baseline = baseline_syncs(tmp_path, plain)
    monitor, _ = host_sync_run(tmp_path, Checkpointed(items=1))
    finding = found(monitor, "host-sync")
    assert finding is not None and finding.figures["syncs_per_step"] == 1 + baseline
    # the counting mode changes nothing the steps compute: same weights as a run without findings
    with SimulatedGpu("A100", memory="1GiB"):
        quiet_trainer(tmp_path, [DataWaitMonitor(warmup_steps=3, verbose=False, find_patterns=False)], max_steps=8).fit(
            reference, DataLoader(preloaded_dataset(256, 32), batch_size=16)
        )
    for mine, theirs in zip(plain.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


class FailsAtStep(ReadsLoss):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom at step 2")
        return super().training_step(batch, batch_idx)


def test_the_counting_mode_is_off_after_an_exception_in_training_step(tmp_path):
    with SimulatedGpu("A100", memory="1GiB"):
        modes_before = torch._C._len_torch_dispatch_stack()
        monitor = DataWaitMonitor(warmup_steps=3, verbose=False)
        trainer = quiet_trainer(tmp_path, [monitor], max_steps=8)
        with pytest.raises(RuntimeError, match="boom at step 2"):
            trainer.fit(FailsAtStep(items=1), DataLoader(preloaded_dataset(256, 32), batch_size=16))
        assert torch._C._len_torch_dispatch_stack() == modes_before
        counter = probe(monitor, HostSyncProbe)
        assert counter.counts == [(1, 1, 0)] and counter._mode is None
    assert torch._C._len_torch_dispatch_stack() == 0
    torch.ones(2).sum().item()  # a later read reaches no counter
    assert counter.counts == [(1, 1, 0)]


def test_host_sync_decides_on_the_users_reads_per_step():
    assert host_sync([1, 2], [1, 0], [3, 3], {"a.py:1": 1}) is None  # once in two steps
    finding = host_sync([1, 2], [2, 2], [1, 1], {"a.py:1": 2, "a.py:9": 2})
    assert finding.figures == {
        "syncs_per_step": 3.0,
        "user_syncs_per_step": 2.0,
        "lightning_syncs_per_step": 1.0,
        "lines": 2.0,
    }
    assert "a.py:1 (1/step)" in finding.message and "and 1 by Lightning itself" in finding.message


LIBRARY = """
def checked(loss):
    if loss.isfinite():  # a library's own read, as transformers' masking_utils makes
        return loss
    raise ValueError("not finite")
"""


class CallsALibrary(MLP):
    """A training step that calls an installed package (in a ``site-packages`` folder) which reads the card."""

    def __init__(self, library) -> None:
        super().__init__()
        self.library = library

    def training_step(self, batch, batch_idx):
        return self.library.checked(super().training_step(batch, batch_idx))  # marker: library call


def test_host_sync_names_the_users_line_that_called_an_installed_package(tmp_path):
    installed = tmp_path / "lib" / "python3.11" / "site-packages" / "padlib.py"
    installed.parent.mkdir(parents=True)
    installed.write_text(LIBRARY)
    spec = importlib.util.spec_from_file_location("padlib", installed)
    library = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(library)
    monitor, _ = host_sync_run(tmp_path, CallsALibrary(library))
    finding = found(monitor, "host-sync")
    assert finding is not None and finding.figures["user_syncs_per_step"] == 1
    assert finding.where == line_of(CallsALibrary.training_step, "marker: library call")
    assert "site-packages" not in finding.message
