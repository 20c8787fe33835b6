"""Run by test_ddp.py under DDP, 2 CPU processes (gloo): ``ddp_script.py OUT MODE[,MODE...]``.

One launch runs the modes one after the other in the same two processes (their own folder each,
``OUT/MODE``), as a user's script may fit several times:

monitor: rank 1's dataset sleeps longer per sample, so it is the straggler. Every rank writes
what its DataWaitMonitor concluded to ``OUT/rank<N>.json``; rank 0 also writes
``gpuopt_report.json``.
tune: every rank runs DataLoaderTuner and writes its result and the loader its fit used.
memory: every rank runs MemoryEstimator; rank 0 writes the report.
nothing-fits: every rank runs BatchSizeSearch with its own budget, in which no batch size fits, and
writes the error's message to ``OUT/nothing<N>.json``.
search: every rank runs BatchSizeSearch with its own budget (rank 0: 20 MB, rank 1: 16 MB) and
writes its result and the batch size its training used to ``OUT/search<N>.json``.
fill: every rank runs MemoryFill for a global batch of 64 with its own budget (rank 0: 60 MB,
rank 1: 7 MB, where micro-batches of 8 fit only with checkpointing) and writes its plan and
what its training used to ``OUT/fill<N>.json``.
oom: every rank trains TokenModel under the same MemoryBudget cap with MemoryFill(on_oom="adapt");
only rank 1's third batch holds long samples, so only rank 1 runs out of memory; every rank writes
its weights to ``OUT/oom<N>.pt`` and its adaptations and global step to ``OUT/oom<N>.json``.
simulated: every rank trains on a simulated A100 of its own size (rank 0: 256 MiB, rank 1: 48 MiB)
with MemoryFill for a global batch of 256 and writes its plan and its card's peak to
``OUT/simulated<N>.json``.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from helpers import MLP, BatchRecorder, SlowDataset, quiet_trainer
from lightning import Trainer
from torch.utils.data import DataLoader

from lightning_gpuopt import DataLoaderTuner, DataWaitMonitor


def ddp_trainer(out: Path, callbacks: list, **settings: Any) -> Trainer:
    """A quiet Trainer of 2 CPU processes under DDP (gloo), as users launch it: this script, run once."""
    return quiet_trainer(out, callbacks, devices=2, strategy="ddp", **settings)


def rank_delay() -> float:
    return 0.004 if dist.is_initialized() and dist.get_rank() == 1 else 0.001


def tune(out: Path) -> None:
    tuner, recorder = DataLoaderTuner(max_seconds=3), BatchRecorder()
    trainer = ddp_trainer(out, [tuner, recorder], max_steps=5)
    # 2 ms a sample: workers clearly help each rank even on a busy machine
    trainer.fit(MLP(), DataLoader(SlowDataset(640, delay_s=0.002), batch_size=8))
    (out / f"tune{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "chosen": list(vars(tuner.result.setting).values()),
                "used": list(recorder.loader_settings),
                "usable_cpus": tuner.result.usable_cpus,
                "sampler": type(trainer.train_dataloader.sampler).__name__,
            }
        )
    )


def memory(out: Path) -> None:
    from models_memory import make_model

    from lightning_gpuopt.callbacks.memory_estimator import MemoryEstimator

    model = make_model("mlp")
    trainer = ddp_trainer(out, [MemoryEstimator(measure_steps=2)], max_steps=4, log_every_n_steps=1)
    trainer.fit(model, model.loader(8))


SEARCH_BUDGETS = ("20MB", "16MB")  # by rank


def search(out: Path) -> None:
    from models_memory import make_model

    from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch
    from lightning_gpuopt.core.report import to_dict

    rank = int(os.environ.get("LOCAL_RANK", "0"))  # known before the processes join: budgets differ by rank
    searcher = BatchSizeSearch(max_memory=SEARCH_BUDGETS[rank], margin=0.1)  # the check bisects at 90%
    model = make_model("mlp", num_samples=4096, batch_size=16)
    trainer = ddp_trainer(out, [searcher], max_steps=2)
    trainer.fit(model)
    (out / f"search{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "result": to_dict(searcher.result),
                "used": trainer.train_dataloader.batch_size,
                "global_step": trainer.global_step,
            }
        )
    )


NOTHING_FITS_BUDGETS = ("60KB", "30KB")  # by rank: the MLP's step at batch size 1 fits neither


def nothing_fits(out: Path) -> None:
    from models_memory import make_model

    from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch, NoBatchSizeFitsError

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    searcher = BatchSizeSearch(max_memory=NOTHING_FITS_BUDGETS[rank], margin=0.1, max_trials=3)
    trainer = ddp_trainer(out, [searcher], max_steps=2)
    try:
        trainer.fit(make_model("mlp", num_samples=256, batch_size=16))
    except NoBatchSizeFitsError as error:
        (out / f"nothing{rank}.json").write_text(json.dumps({"message": str(error)}))


FILL_BUDGETS = ("60MB", "7MB")  # by rank


def fill(out: Path) -> None:
    from lightning import Callback
    from models_memory import make_model

    from lightning_gpuopt import MemoryFill
    from lightning_gpuopt.core.report import to_dict

    class Used(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen = (
                len(batch[0]),
                trainer.accumulate_grad_batches,
                "forward" in vars(pl_module.network.encoder.layers[0]),
            )

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    memory_fill, used = MemoryFill(global_batch_size=64, max_memory=FILL_BUDGETS[rank]), Used()
    model = make_model("transformer", num_samples=512, batch_size=16)
    trainer = ddp_trainer(out, [memory_fill, used], max_steps=2)
    trainer.fit(model)
    (out / f"fill{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "plan": to_dict(memory_fill.plan),
                "used": used.seen,
                "global_step": trainer.global_step,
            }
        )
    )


SIMULATED_CARDS = (
    "256MiB",
    "48MiB",  # two cuBLAS workspaces (8.1 MiB each, forward and autograd threads) and room to train
)  # by rank: a simulated A100 of this size in each process (bf16: a T4's fp16 convolutions take 80x longer on CPU)


def simulated(out: Path) -> None:
    from models_memory import make_model

    from lightning_gpuopt import MemoryFill
    from lightning_gpuopt.core.report import to_dict
    from lightning_gpuopt.testing import SimulatedGpu

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    model = make_model("cnn", num_samples=1024, batch_size=8)
    with SimulatedGpu("A100", memory=SIMULATED_CARDS[rank]) as gpu:
        memory_fill = MemoryFill(
            global_batch_size=512, activation_checkpointing=False, max_trials=4
        )  # max_memory: each card
        trainer = ddp_trainer(out, [memory_fill], max_steps=2)
        trainer.fit(model)
    (out / f"simulated{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "plan": to_dict(memory_fill.plan),
                "global_step": trainer.global_step,
                "peak_reserved": gpu.peak_reserved_bytes,
                "card": gpu.profile.total_bytes,
            }
        )
    )


def oom_rank_indices(size: int = 64) -> list[list[int]]:
    """The samples each rank trains, in order: Lightning's DistributedSampler (shuffled, seed 0, epoch 0)."""
    from torch.utils.data import DistributedSampler

    return [list(DistributedSampler(range(size), num_replicas=2, rank=rank, shuffle=True, seed=0)) for rank in (0, 1)]


OOM_LONG = tuple(oom_rank_indices()[1][16:18])  # two long samples in rank 1's third batch only


def oom(out: Path) -> None:
    import torch
    from oom_models import CapDuringTraining, TokenModel, VariableLengthDataset, pad_collate, step_peak

    from lightning_gpuopt import MemoryFill
    from lightning_gpuopt.core.report import to_dict

    dataset = VariableLengthDataset(64, long_at=OOM_LONG, long=128)
    # short batches fit with a wide room (DDP adds its buckets, and gloo's communication buffers are
    # freed late on a loaded machine: 3x a short step was once not enough), the long batch (9.5x a
    # short step's peak) does not
    cap = int(5 * step_peak(TokenModel(dataset), pad_collate([dataset[i] for i in range(8)])))
    model = TokenModel(dataset, batch_size=8)
    memory_fill = MemoryFill(
        global_batch_size=16, max_memory="1GB", activation_checkpointing=False, on_oom="adapt", verbose=False
    )
    trainer = ddp_trainer(out, [memory_fill, CapDuringTraining(cap)], max_steps=4, limit_val_batches=0)
    trainer.fit(model)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"oom{trainer.global_rank}.pt")
    (out / f"oom{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "adaptations": [to_dict(a) for a in memory_fill.plan.oom_adaptations],
                "global_step": trainer.global_step,
            }
        )
    )


def main(out: Path) -> None:
    monitor = DataWaitMonitor(warmup_steps=2)  # default report path: trainer.log_dir, a collective
    trainer = ddp_trainer(out, [monitor], max_steps=20)
    dataset = SlowDataset(640, delay_for=rank_delay)
    trainer.fit(MLP(), DataLoader(dataset, batch_size=8))
    report = monitor.report
    # ground truth: the seconds this rank's samples really took after the 2 warm-up batches (a loaded
    # machine oversleeps), per measured step
    loading_per_step_s = dataset.loading_time(2 * 8) / (len(dataset.durations) // 8 - 2)
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "verdict": report.verdict,
                "straggler_rank": report.diagnosis.straggler_rank,
                "world_size": report.world_size,
                "recommendations": report.recommendations,
                "loading_per_step_s": loading_per_step_s,
            }
        )
    )


if __name__ == "__main__":
    modes = {
        "monitor": main,
        "tune": tune,
        "memory": memory,
        "search": search,
        "fill": fill,
        "simulated": simulated,
        "nothing-fits": nothing_fits,
        "oom": oom,
    }
    try:
        for mode in (sys.argv[2] if len(sys.argv) > 2 else "monitor").split(","):
            (Path(sys.argv[1]) / mode).mkdir(parents=True, exist_ok=True)
            modes[mode](Path(sys.argv[1]) / mode)
    finally:
        # as a user's script must under gloo: a process that exits with its process group alive can be
        # killed by SIGABRT ("terminate called without an active exception") while Python shuts down
        # (pytorch/pytorch#190489); Lightning destroys it at exit for NCCL only
        if dist.is_initialized():
            dist.destroy_process_group()
