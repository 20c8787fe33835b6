"""Train with LightningCLI and one flag: ``--gpuopt PRESET`` (GpuOptCLI).

The model is :class:`models.TokenTransformer` (synthetic data, no download). Every LightningCLI
option works as usual; ``--gpuopt`` adds lightning-gpuopt's GpuOpt callback from a preset or a
YAML file, with dotted overrides:

    python examples/cli_train.py fit --trainer.max_steps 20                    # plain LightningCLI
    python examples/cli_train.py fit --gpuopt diagnose --trainer.max_steps 20  # measure only
    python examples/cli_train.py fit --gpuopt fill-memory --gpuopt.max_memory 40MB \\
        --gpuopt.global_batch_size 128 --trainer.max_steps 20                  # on CPU: a simulated budget
    python examples/cli_train.py fit --gpuopt examples/configs/team.yaml --trainer.max_steps 20
    python examples/cli_train.py fit --config examples/configs/fill-memory-cli.yaml

The Trainer's defaults are LightningCLI's (``accelerator="auto"``): on a GPU machine,
``--gpuopt max-throughput`` fills the card (``max_memory`` defaults to its free memory).
The resolved settings are saved in the run's ``config.yaml``.
"""

from __future__ import annotations

from models import TokenTransformer  # examples/models.py: Python puts this script's folder on sys.path

from lightning_gpuopt import GpuOptCLI


def main() -> None:
    GpuOptCLI(TokenTransformer)


if __name__ == "__main__":
    main()
