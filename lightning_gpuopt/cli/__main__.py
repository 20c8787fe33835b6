"""``python -m lightning_gpuopt.cli ARGS``: the ``gpuopt`` console command."""

from lightning_gpuopt.cli.command import main

if __name__ == "__main__":
    raise SystemExit(main())
