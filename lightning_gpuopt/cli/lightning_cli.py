""":class:`GpuOptCLI`: ``LightningCLI`` with ``--gpuopt PRESET`` and ``--gpuopt.KEY`` flags (it imports Lightning,
which :mod:`.command` must not do before a subcommand runs)."""

from __future__ import annotations

import re
import sys
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks.gpuopt import GpuOpt
from lightning_gpuopt.presets import PRESET_KEYS, available_presets, load_preset, preset_description

_KEY = "gpuopt"


class ResolvedDumps:
    """Mixed into a ``LightningArgumentParser``: ``--print_config`` and ``config.yaml`` hold ``gpuopt`` resolved."""

    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:
        group = cfg.get(_KEY) if isinstance(cfg, Namespace) else None
        if isinstance(group, Namespace):
            cfg = cfg.clone()
            cfg[_KEY] = Namespace(_resolved(self, group.as_dict()))
        return super().dump(cfg, *args, **kwargs)  # type: ignore[misc]


class GpuOptArgumentParser(ResolvedDumps, LightningArgumentParser):
    """Lightning's parser with :class:`ResolvedDumps`."""


class WithGpuOpt:
    """Mixed into a ``LightningCLI`` (of either Lightning namespace): the ``--gpuopt`` flag of :class:`GpuOptCLI`."""

    #: the callback the flag adds, and the parser class used unless one is passed
    gpuopt_class: type = GpuOpt
    default_parser_class: type = GpuOptArgumentParser
    config: Any
    config_init: Any
    subcommand: Any
    parser: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", self.default_parser_class)  # keep dumps resolved: subclass it for your own
        super().__init__(*args, **kwargs)

    def add_default_arguments_to_parser(self, parser: Any) -> None:
        """Lightning's defaults, then ``--gpuopt`` (here, so a subclass's ``add_arguments_to_parser`` need not)."""
        super().add_default_arguments_to_parser(parser)  # type: ignore[misc]
        parser.add_class_arguments(GpuOpt, _KEY, fail_untyped=False, instantiate=False, sub_configs=True)
        parser.set_defaults({f"{_KEY}.preset": None})
        actions = compat.parser_option_actions(parser)
        gist = re.compile(r"\. |: | \(")  # a preset's description up to its first stop
        presets = "; ".join(f"{n} ({gist.split(preset_description(n), 1)[0].rstrip('.')})" for n in available_presets())
        flag = f"a preset name or the path of a YAML file of GpuOpt settings (which may say `preset: NAME` to extend one): adds a GpuOpt callback; each --gpuopt.<setting> below overrides the preset's. Presets: {presets}. `gpuopt presets NAME` shows one's settings."
        actions[f"--{_KEY}"].help, actions[f"--{_KEY}"].metavar = flag, "PRESET_OR_YAML"
        actions[f"--{_KEY}.preset"].help = "the same as --gpuopt PRESET_OR_YAML"
        for key, meaning in PRESET_KEYS.items():
            actions[f"--{_KEY}.{key}"].help = f"{meaning} (null: the preset's value)"

    def parse_arguments(self, parser: Any, args: Any) -> None:
        if args is None:
            sys.argv[1:] = preset_flag_as_key(sys.argv[1:])
        elif isinstance(args, list):
            args = preset_flag_as_key(args)
        super().parse_arguments(parser, args)  # type: ignore[misc]

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()  # type: ignore[misc]
        config = self.config.get(str(self.subcommand), self.config)
        if config.get(_KEY) is not None:
            config[_KEY] = Namespace(_resolved(self.parser, config[_KEY].as_dict()))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        group = self.config.get(str(self.subcommand), self.config).get(_KEY)
        settings = {key: value for key, value in (group.as_dict() if group else {}).items() if value is not None}
        if not settings:  # --gpuopt not used
            return super().instantiate_trainer(**kwargs)  # type: ignore[misc]
        trainer = self.config_init.get(str(self.subcommand), self.config_init).get("trainer", {})
        callbacks = kwargs.pop("callbacks", trainer.get("callbacks"))
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list) else [callbacks]
        return super().instantiate_trainer(callbacks=[*callbacks, self.gpuopt_class(**settings)], **kwargs)  # type: ignore[misc]


class GpuOptCLI(WithGpuOpt, LightningCLI):
    """``LightningCLI`` with the flag ``--gpuopt``: a preset's name or a YAML file, plus ``--gpuopt.KEY`` overrides;
    with it a :class:`~lightning_gpuopt.GpuOpt` built from them joins the Trainer's callbacks (see docs/cli.md)."""


def _resolved(parser: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with the preset's values under the overrides, checked by a :class:`GpuOpt`; else exit 2."""
    given = {key: value for key, value in settings.items() if value is not None}
    if not given:
        return settings
    try:
        resolved = {**settings, **(load_preset(given["preset"]) if given.get("preset") else {}), **given}
        GpuOpt(**resolved)
    except ValueError as error:
        parser.error(f"--{_KEY}: {error}")
    return resolved


def preset_flag_as_key(argv: list[str]) -> list[str]:
    """``--gpuopt X`` and ``--gpuopt=X`` as ``--gpuopt.preset X``."""
    flag = f"--{_KEY}"
    return [f"{flag}.preset{arg[len(flag) :]}" if arg == flag or arg.startswith(f"{flag}=") else arg for arg in argv]
