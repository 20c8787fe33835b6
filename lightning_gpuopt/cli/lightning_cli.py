""":class:`GpuOptCLI`: Lightning's ``LightningCLI`` with a ``--gpuopt PRESET`` flag, and its helpers.

Apart from :mod:`lightning_gpuopt.cli.command` (the ``gpuopt`` console command) because it imports
Lightning at the top, which the console command must not.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_gpuopt.callbacks import _lightning_compat as compat
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

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Lightning's parser, whose ``dump`` (``--print_config``, the saved ``config.yaml``) shows the
        resolved ``gpuopt`` settings -- the preset's values with the overrides applied -- not nulls."""
        parser = super().init_parser(**kwargs)
        dump = parser.dump

        def dump_resolved(namespace: Any, *args: Any, **dump_kwargs: Any) -> str:
            return dump(self._with_resolved_gpuopt(parser, namespace), *args, **dump_kwargs)

        parser.dump = dump_resolved
        return parser

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Lightning's default arguments, then ``--gpuopt`` and its settings. Added here rather than in
        :meth:`add_arguments_to_parser`, so a subclass overriding that hook need not call ``super()``."""
        super().add_default_arguments_to_parser(parser)
        add_gpuopt_arguments(parser)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is None:
            sys.argv[1:] = preset_flag_as_key(sys.argv[1:])
        elif isinstance(args, list):
            args = preset_flag_as_key(args)
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        group = self.config.get(str(self.subcommand), self.config).get(GPUOPT_KEY)
        if group is None:
            return
        resolved = self._resolved(compat.cli_parser(self, self.subcommand), group.as_dict())
        for key, value in resolved.items():
            group[key] = value  # the saved config.yaml holds every setting, not just the preset's name

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        settings = self._gpuopt_settings()
        if settings is None:
            return super().instantiate_trainer(**kwargs)
        callbacks = kwargs.pop(
            "callbacks", compat.cli_config_value(self, self.config_init, "trainer", default={}).get("callbacks")
        )
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list) else [callbacks]
        gpuopt = GpuOpt(**{k: v for k, v in settings.items() if v is not None})
        return super().instantiate_trainer(callbacks=[*callbacks, gpuopt], **kwargs)

    def _gpuopt_settings(self) -> Optional[dict[str, Any]]:
        """The ``gpuopt`` group as a dict, or ``None`` when ``--gpuopt`` was not used."""
        group = self.config.get(str(self.subcommand), self.config).get(GPUOPT_KEY)
        settings = group.as_dict() if group is not None else {}
        return settings if any(value is not None for value in settings.values()) else None

    @staticmethod
    def _resolved(parser: LightningArgumentParser, settings: dict[str, Any]) -> dict[str, Any]:
        """``settings`` with the preset's values filled in (overrides win), checked by building a
        GpuOpt before the model and Trainer are; a bad one ends the command with a usage error (exit 2)."""
        if not any(value is not None for value in settings.values()):
            return settings  # --gpuopt not used: nothing to resolve
        try:
            return resolved_gpuopt_settings(settings)
        except ValueError as error:
            parser.error(f"--{GPUOPT_KEY}: {error}")
            raise  # parser.error exits; for type checkers

    def _with_resolved_gpuopt(self, parser: LightningArgumentParser, namespace: Any) -> Any:
        group = namespace.get(GPUOPT_KEY) if hasattr(namespace, "get") else None
        if group is None or not hasattr(group, "as_dict"):
            return namespace
        namespace = namespace.clone()
        for key, value in self._resolved(parser, group.as_dict()).items():
            namespace[f"{GPUOPT_KEY}.{key}"] = value
        return namespace


def resolved_gpuopt_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The ``gpuopt`` group's settings with its preset's values filled in (the overrides win), checked
    by building a :class:`GpuOpt` from them; a ``ValueError`` names a bad one.

    Example::

        >>> resolved = resolved_gpuopt_settings({"preset": "diagnose", "monitor": None, "estimate": False})
        >>> resolved["preset"], resolved["monitor"], resolved["estimate"]
        ('diagnose', True, False)
    """
    preset = settings.get("preset")
    resolved = {
        **settings,
        **(load_preset(preset) if preset else {}),
        **{key: value for key, value in settings.items() if value is not None},
    }
    GpuOpt(**resolved)
    return resolved


def gpuopt_help() -> str:
    """The help text of ``--gpuopt``: what it takes, and the shipped presets with what each does."""
    from lightning_gpuopt.presets import available_presets, preset_description

    def gist(name: str) -> str:  # the description's first clause
        return re.split(r"\. |: | \(", preset_description(name), maxsplit=1)[0].rstrip(".")

    presets = "; ".join(f"{name} ({gist(name)})" for name in available_presets())
    return (
        f"a preset name or the path of a YAML file of GpuOpt settings (which may say `preset: NAME` to extend "
        f"one): adds a GpuOpt callback; each --gpuopt.<setting> below overrides the preset's. Presets: {presets}. "
        "`gpuopt presets NAME` shows one's settings."
    )


def add_gpuopt_arguments(parser: LightningArgumentParser) -> None:
    """``--gpuopt`` and ``--gpuopt.<setting>`` (every key of a preset), each with its help text."""
    from lightning_gpuopt.presets import PRESET_KEYS

    if f"--{GPUOPT_KEY}.preset" in compat.parser_option_actions(parser):  # already added to this parser
        return
    parser.add_class_arguments(GpuOpt, GPUOPT_KEY, fail_untyped=False, instantiate=False, sub_configs=True)
    parser.set_defaults({f"{GPUOPT_KEY}.preset": None})
    actions = compat.parser_option_actions(parser)
    flag = actions.get(f"--{GPUOPT_KEY}")  # `--gpuopt X` is read as `--gpuopt.preset X` (preset_flag_as_key)
    if flag is not None:
        flag.help, flag.metavar = gpuopt_help(), "PRESET_OR_YAML"
    actions[f"--{GPUOPT_KEY}.preset"].help = "the same as --gpuopt PRESET_OR_YAML"
    for key, meaning in PRESET_KEYS.items():
        actions[f"--{GPUOPT_KEY}.{key}"].help = f"{meaning} (null: the preset's value)"


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
