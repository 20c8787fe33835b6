"""Run by test_ddp.py: DataWaitMonitor under DDP, 2 CPU processes (gloo).

Rank 1's dataset sleeps longer per sample, so it is the straggler. Every rank writes what
its monitor concluded to ``OUT/rank<N>.json``; rank 0 also writes ``gpuopt_report.json``.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from lightning import Trainer
from torch.utils.data import DataLoader

from helpers import MLP, SlowDataset
from lightning_gpuopt import DataWaitMonitor


def rank_delay() -> float:
    return 0.004 if dist.is_initialized() and dist.get_rank() == 1 else 0.001


def main(out: Path) -> None:
    monitor = DataWaitMonitor(warmup_steps=2, report_path=out / "gpuopt_report.json")
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=20,
        callbacks=[monitor],
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(SlowDataset(640, delay_for=rank_delay), batch_size=8)
    trainer.fit(MLP(), loader)
    report = monitor.report
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps({"verdict": report.verdict, "straggler_rank": report.straggler_rank,
                    "world_size": report.world_size, "recommendations": report.recommendations})
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
