"""GpuOptCLI: LightningCLI with a ``--gpuopt`` flag (moved into cli.py on merge)."""

from __future__ import annotations

import sys
from typing import Any, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_gpuopt.callbacks.gpuopt import GpuOpt
from lightning_gpuopt.presets import load_preset

#: the group of GpuOpt's settings on the command line and in config files
GPUOPT_KEY = "gpuopt"


class GpuOptCLI(LightningCLI):
    r"""``LightningCLI`` with one more flag, ``--gpuopt``: a preset name or YAML file, plus dotted overrides.

    Without ``--gpuopt`` nothing changes. With it, a :class:`~lightning_gpuopt.GpuOpt` callback built from
    the preset and the overrides joins the Trainer's callbacks, and the resolved settings (every key
    of the preset, overrides applied) are written into the ``gpuopt:`` section of the saved
    ``config.yaml``, so ``--config config.yaml`` runs the same again.

    Example::

        # train.py
        from lightning_gpuopt import GpuOptCLI
        GpuOptCLI(MyModel, MyDataModule)

        python train.py fit --gpuopt fill-memory
        python train.py fit --gpuopt fill-memory --gpuopt.max_memory 0.9 --gpuopt.amp false
        python train.py fit --gpuopt my-team.yaml            # a YAML of settings, may say `preset: fill-memory`
        python train.py fit --config config.yaml             # a config with a `gpuopt:` section

    Presets and keys are checked before anything is built: an unknown one ends the command with a
    usage error (exit status 2) listing the valid ones.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_class_arguments(GpuOpt, GPUOPT_KEY, fail_untyped=False, instantiate=False, sub_configs=True)
        parser.set_defaults({f"{GPUOPT_KEY}.preset": None})

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is None:
            sys.argv[1:] = preset_flag_as_key(sys.argv[1:])
        elif isinstance(args, list):
            args = preset_flag_as_key(args)
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        settings = self._gpuopt_settings()
        if settings is None:
            return
        try:
            resolved = {**(load_preset(settings["preset"]) if settings.get("preset") else {}),
                        **{k: v for k, v in settings.items() if v is not None}}  # fmt: skip
            GpuOpt(**resolved)  # checks every value before the model and Trainer are built
        except ValueError as error:
            self._parser(self.subcommand).error(f"--{GPUOPT_KEY}: {error}")
        group = self.config.get(str(self.subcommand), self.config)[GPUOPT_KEY]
        for key, value in resolved.items():
            group[key] = value  # the saved config.yaml holds every setting, not just the preset's name

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        settings = self._gpuopt_settings()
        if settings is None:
            return super().instantiate_trainer(**kwargs)
        callbacks = kwargs.pop("callbacks", self._get(self.config_init, "trainer", default={}).get("callbacks"))
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list) else [callbacks]
        gpuopt = GpuOpt(**{k: v for k, v in settings.items() if v is not None})
        return super().instantiate_trainer(callbacks=[*callbacks, gpuopt], **kwargs)

    def _gpuopt_settings(self) -> Optional[dict[str, Any]]:
        """The ``gpuopt`` group as a dict, or ``None`` when ``--gpuopt`` was not used."""
        group = self.config.get(str(self.subcommand), self.config).get(GPUOPT_KEY)
        settings = group.as_dict() if group is not None else {}
        return settings if any(value is not None for value in settings.values()) else None


def preset_flag_as_key(argv: list[str]) -> list[str]:
    """``--gpuopt NAME_OR_YAML`` (or ``--gpuopt=…``) → ``--gpuopt.preset …``, so a preset name and a
    settings file are read the same way as :class:`GpuOpt` reads them.

    Example::

        >>> preset_flag_as_key(["fit", "--gpuopt", "fill-memory", "--gpuopt.amp", "false"])
        ['fit', '--gpuopt.preset', 'fill-memory', '--gpuopt.amp', 'false']
    """
    rewritten = []
    for arg in argv:
        if arg == f"--{GPUOPT_KEY}":
            arg = f"--{GPUOPT_KEY}.preset"
        elif arg.startswith(f"--{GPUOPT_KEY}="):
            arg = f"--{GPUOPT_KEY}.preset=" + arg.split("=", 1)[1]
        rewritten.append(arg)
    return rewritten
