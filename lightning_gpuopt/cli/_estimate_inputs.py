"""What ``gpuopt estimate`` computes, from its arguments: the model and ``--datamodule`` built as LightningCLI builds
its classes (:func:`_instantiate`), a Trainer attached to a LightningModule, a batch and its loss, the optimizer and the
memory to fit. Each refusal is a :class:`UsageError` naming the argument, the value and what works.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, cast

import torch
from jsonargparse import get_loader
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.plugins import HalfPrecision
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._engine.steps import loss_function, manual_step
from lightning_gpuopt.cli.command import DEFAULT_BATCH_SIZE, UsageError
from lightning_gpuopt.core._torch_compat import tree_leaves
from lightning_gpuopt.core.device import cuda_available, device_for
from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep, batch_to_trace, host_step_context, sliced_batch
from lightning_gpuopt.core.loader import batch_samples
from lightning_gpuopt.core.memory import parse_memory

#: the Trainer a LightningModule gets (``estimated_stepping_batches`` reads ``max_steps``)
_TRAINER: dict[str, Any] = dict(accelerator="cpu", devices=1, max_epochs=-1, max_steps=1000, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip


@dataclasses.dataclass
class EstimateSetup:
    """What ``gpuopt estimate`` ran with (the ``"setup"`` key of its JSON)."""

    model: str
    device: str
    precision: str
    datamodule: str = ""
    parameters: int = 0
    batch_source: str = ""
    batch_size: int | None = None
    loss: str = ""
    optimizer: str = ""
    memory_source: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)


def estimate_of(args: argparse.Namespace) -> tuple[Any, EstimateSetup]:
    """The ``MemoryEstimate`` of ``gpuopt estimate ARGS`` and the setup it ran with."""
    for name, value in (("--batch-size", args.batch_size), ("--vocab", args.vocab)):
        if value is not None and value < 1:
            raise UsageError(f"`{name}`={value} must be a positive integer, e.g. {name} 8.")
    if args.device == "cuda" and not cuda_available():
        raise UsageError("`--device`='cuda' but CUDA is not available here (see `gpuopt doctor`); use --device cpu.")
    device = torch.device(args.device or ("cuda" if cuda_available() else "cpu"))
    if args.precision == "16-mixed" and device.type != "cuda":
        why = f"needs CUDA and the device is {device.type}; on a CPU use --precision bf16-mixed."
        raise UsageError(f"`--precision`='16-mixed' {why}")
    cls = _import_class(args.target, "MODULE:CLASS", torch.nn.Module, "torch.nn.Module")
    module = _instantiate(cls, args.init_args, "--init-args", "model")
    setup = EstimateSetup(model=f"{cls.__module__}.{cls.__qualname__}", device=str(device), precision=args.precision)
    # the model and the batch stay on the host (nothing is moved to a GPU): a CUDA run is traced there under a
    # CPU autocast of its dtype, and the device sets the 512-byte blocks and the cuBLAS workspace
    module = module.to("cpu").train()
    module = module.to(torch.bfloat16) if args.precision == "bf16-true" else module
    trainer, datamodule = _trainer_and_datamodule(module, args, setup)
    batch, loss_fn, inputs, traced = _batch_and_loss(module, args, setup, datamodule)
    setup.batch_size = batch_samples(batch)
    optimizers = _optimizers(module, args.optimizer, setup)
    if args.max_memory is None:
        setup.memory_source = f"what {device} can give a training step now (free + held by torch)"
        capacity = device_for(device).usable_memory([module])
    else:
        text, setup.memory_source = args.max_memory.strip(), f"--max-memory {args.max_memory}"
        value = int(text) if text.isdigit() else float(text) if re.fullmatch(r"\d*\.\d+", text) else args.max_memory
        try:
            capacity = parse_memory(value, device, name="--max-memory")
        except ValueError as error:
            raise UsageError(str(error)) from None
    # a manually optimized LightningModule on a dataloader's batch: its whole training_step, the Trainer attached
    manual = None
    loaded = setup.batch_source.endswith("train_dataloader()") and not args.input_size
    if trainer is not None and not module.automatic_optimization and loaded and is_overridden("training_step", module):
        trainer.strategy.optimizers = optimizers  # what self.optimizers() reads outside the trace
        setup.loss = "the model's training_step() (manual optimization: its own backward passes and optimizer steps)"
        setup.notes[:] = [note for note in setup.notes if "stand-in" not in note]
        manual = manual_step(trainer, module)
    context, size = host_step_context(args.precision), setup.batch_size
    step = TrainingStep(module, batch, loss_fn, manual, optimizers, size, context, device, forward_input=inputs)
    estimator = StepEstimator(step)  # kernel workspaces are learned once, for the estimate and the re-traces
    estimate = estimator.estimate(capacity)
    if estimate.max_batch_size and setup.batch_size and estimate.max_batch_size > 2 * setup.batch_size:
        estimate = estimator.refined(estimate)  # as BatchSizeSearch does; beyond 2B the line extrapolates
    estimate = estimate if traced is None else estimate.traced_on(batch, *traced)
    return dataclasses.replace(estimate, notes=[*setup.notes, *estimate.notes]), setup


def _import_class(target: str, argument: str, base: type, base_name: str) -> type:
    """The ``base`` class named by ``MODULE:CLASS`` (a dotted module, or ``path/to/file.py``)."""
    label = f"`{argument}`={target!r}"
    module_part, _, class_part = target.rpartition(":")
    if not module_part or not class_part:
        why = "give the module (dotted, or path/to/file.py), a colon and the class, e.g. examples/models.py:TokenTransformer or my_package.models:MyModel."
        raise UsageError(f"{label} is not MODULE:CLASS: {why}")
    path = Path(module_part).expanduser().resolve() if module_part.endswith(".py") or "/" in module_part else None
    if path is not None and not path.is_file():
        why = f"the file {module_part!r} does not exist (looked for {path}); give an existing path/to/file.py or a dotted module."
        raise UsageError(f"{label}: {why}")
    folder, name = (str(path.parent), path.stem) if path is not None else (os.getcwd(), module_part)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - the user's module, or one it imports, failed
        why = f"the module part {module_part!r} cannot be imported ({type(error).__name__}: {error}); it is looked up on sys.path and in the current directory {os.getcwd()}; give a dotted module path or path/to/file.py."
        raise UsageError(f"{label}: {why}") from None
    if path is not None and Path(getattr(module, "__file__", None) or "").resolve() != path:
        raise UsageError(f"{label}: another module named {name!r} is imported already ({module}); rename the file.")
    cls = getattr(module, class_part, None)
    if isinstance(cls, type) and issubclass(cls, base):
        return cls
    classes = {key: value for key, value in vars(module).items() if isinstance(value, type)}
    ours = sorted(key for key, value in classes.items() if issubclass(value, base) and value.__module__ == name)
    close = difflib.get_close_matches(class_part, ours, 1) if cls is None else []
    problem = f"the module {module_part!r} has no attribute {class_part!r};"
    problem += f" did you mean {close[0]!r}?" if close else ""
    if cls is not None:
        kind = "class" if isinstance(cls, type) else type(cls).__name__
        problem = f"{class_part!r} is a {kind}, not a {base_name} class;"
    raise UsageError(f"{label}: {problem} the module's {base_name} classes: {', '.join(ours) or 'none'}.")


def _instantiate(cls: type, text: str, flag: str, key: str) -> Any:
    """``cls`` built from ``flag``'s ``text`` as LightningCLI builds its ``key`` group: jsonargparse checks the
    typed arguments and builds those given as ``class_path``; untyped ones and ``**kwargs`` pass as given."""
    label, signature = f"`{flag}`={text!r}", _signature(cls)
    shown = f"{cls.__name__}{signature or '(...)'}"
    given = _init_args(text, label, shown)
    parameters = signature.parameters if signature is not None else {}
    by_name = [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [name for name in given if name not in by_name]
    if signature is not None and unknown and all(p.kind is not p.VAR_KEYWORD for p in parameters.values()):
        close = difflib.get_close_matches(unknown[0], by_name, 1)
        why = f"unexpected keyword argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} (unknown key{f'; did you mean {close[0]!r}?' if close else ''})"
        raise UsageError(f"{label}: {why}; the signature is {shown}.")
    untyped = {name for name, parameter in parameters.items() if parameter.annotation is parameter.empty}
    typed = {name: value for name, value in given.items() if name in by_name and name not in untyped}
    parser = LightningArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls, key, skip=untyped, instantiate=False, fail_untyped=False, sub_configs=True)
    except Exception:  # noqa: BLE001 - a signature jsonargparse cannot read: the constructor checks its arguments
        typed = {}
    else:
        try:
            config = parser.parse_object({key: typed}, defaults=False)
            built = (getattr(parser, "instantiate", None) or parser.instantiate_classes)(config)  # 4.49 renamed it
        except Exception as error:  # noqa: BLE001 - jsonargparse's checks, or a class given as class_path raised
            reason = " ".join(str(error).split())
            if not isinstance(error, argparse.ArgumentError):
                reason = f"a class given as class_path raised {type(error).__name__}: {reason}"
            raise UsageError(f"{label}: {reason}; the signature is {shown}.") from None
        typed = {name: built[key][name] for name in typed}
    try:
        return cls(**{**given, **typed})
    except Exception as error:  # noqa: BLE001 - the class's own checks of its arguments
        why = f"{cls.__name__}(...) raised {type(error).__name__}: {error}; the signature is {shown}."
        raise UsageError(f"{label}: {why}") from None


def _init_args(text: str, label: str, signature: str) -> dict[str, Any]:
    """The keyword arguments in ``text``: a JSON or YAML mapping, or a .yaml/.json file of one."""
    works = f"give a mapping such as 'width: 256' or '{{\"width\": 256}}', or a .yaml/.json file of one; the signature is {signature}."
    path = Path(text.strip()).expanduser()
    if "\n" not in text.strip() and path.suffix.lower() in (".yaml", ".yml", ".json"):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            what = f"does not exist (looked for {path.resolve()})" if not path.exists() else f"cannot be read ({error})"
            raise UsageError(f"{label}: the file {text.strip()!r} {what}; {works}") from None
    try:
        value = get_loader("yaml")(text) if text.strip() else None
    except Exception as error:  # noqa: BLE001 - the YAML parser's errors
        raise UsageError(f"{label} is not JSON or YAML ({' '.join(str(error).split())}); {works}") from None
    if value is not None and not (isinstance(value, dict) and all(isinstance(name, str) for name in value)):
        raise UsageError(f"{label} is a {type(value).__name__} ({value!r:.200}), not a mapping of names; {works}")
    return value or {}


def _signature(cls: type) -> inspect.Signature | None:
    for eval_str in (True, False):
        with contextlib.suppress(Exception):  # an annotation's NameError, or no signature: the next way
            return inspect.signature(cls, eval_str=eval_str).replace(return_annotation=inspect.Signature.empty)
    return None


def _trainer_and_datamodule(module: Any, args: argparse.Namespace, setup: EstimateSetup) -> tuple[Any, Any]:
    """A CPU Trainer attached as ``fit`` attaches, and the ``--datamodule``; ``(None, None)`` for a plain module."""
    datamodule = None
    if args.datamodule is not None:
        base = "lightning.pytorch.LightningDataModule"
        cls = _import_class(args.datamodule, "--datamodule", LightningDataModule, base)
        datamodule = _instantiate(cls, args.datamodule_init_args, "--datamodule-init-args", "data")
        setup.datamodule = f"{type(datamodule).__module__}.{type(datamodule).__qualname__}"
    elif args.datamodule_init_args.strip() not in ("", "{}"):
        why = "without --datamodule: name the class too, e.g. --datamodule my_package.data:MyData."
        raise UsageError(f"`--datamodule-init-args`={args.datamodule_init_args!r} {why}")
    if not isinstance(module, LightningModule):
        if datamodule is not None:
            why = f"needs a LightningModule to train on its batches; `MODULE:CLASS`={args.target!r} is a plain torch.nn.Module."
            raise UsageError(f"`--datamodule`={args.datamodule!r} {why}")
        return None, None
    logging.disable(logging.INFO)  # no "GPU available: ..." lines in the command's output
    try:
        trainer = Trainer(**_TRAINER)
    finally:
        logging.disable(logging.NOTSET)
    compat.attach_data(trainer, module, datamodule=datamodule)
    trainer.strategy.connect(module)
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup(stage="fit")
    return trainer, datamodule


def _batch_and_loss(module: Any, args: argparse.Namespace, setup: EstimateSetup, datamodule: Any) -> tuple:
    """``(batch, loss_fn, forward_input, (what, unseen))`` from --input-size, a dataloader (``(what, unseen)`` as
    :func:`~lightning_gpuopt.core.estimate.batch_to_trace` says; else ``None``), else example_input_array."""
    setup.parameters = sum(p.numel() for p in module.parameters())
    if args.input_size:
        tensors = []
        for text in args.input_size:
            sizes = [int(size) for size in re.findall(r"\d+", text)]
            if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", text) or min(sizes) < 1:
                why = "is not a list of positive integers; give one sample's shape without the batch dimension, e.g. --input-size 3,224,224."
                raise UsageError(f"`--input-size`={text!r} {why}")
            shape = (args.batch_size or DEFAULT_BATCH_SIZE, *sizes)
            if args.dtype == "long":
                embeddings = [int(m.num_embeddings) for m in module.modules() if isinstance(m, torch.nn.Embedding)]
                if args.vocab is None and not embeddings:
                    why = "needs the range of the token ids and the model has no nn.Embedding; give it with --vocab N, e.g. --vocab 32000."
                    raise UsageError(f"`--dtype`='long' {why}")
                tensors.append(torch.randint(0, args.vocab or embeddings[0], shape, device="cpu"))
            else:
                dtype = torch.bfloat16 if args.precision == "bf16-true" else getattr(torch, args.dtype)
                tensors.append(torch.randn(shape, device="cpu").to(dtype))
        batch = tensors[0] if len(tensors) == 1 else tuple(tensors)
        setup.batch_source = f"random {args.dtype} tensors of size {' and '.join(args.input_size)} (--input-size)"
        return batch, _stand_in_loss_fn(module, setup), batch, None
    if (found := _loader_batch(module, args.batch_size, setup, datamodule)) is not None:
        return found
    example = getattr(module, "example_input_array", None)
    if example is None:
        why = "it has no train_dataloader() and no example_input_array; pass --input-size (e.g. --input-size 3,224,224, or --input-size 128 --dtype long for token ids), or for a LightningModule --datamodule MODULE:CLASS (a LightningDataModule whose train_dataloader() gives the batches)."
        raise UsageError(f"`MODULE:CLASS`={args.target!r} gives no batch: {why}")
    batch = _on_host(example, module)
    batch = sliced_batch(batch, batch_samples(batch), args.batch_size or DEFAULT_BATCH_SIZE)
    setup.batch_source = "example_input_array, resized to the batch size"
    return batch, _stand_in_loss_fn(module, setup), batch, None


def _loader_batch(module: Any, batch_size: int | None, setup: EstimateSetup, datamodule: Any) -> tuple | None:
    """A batch of the datamodule's or the model's ``train_dataloader()``, ``training_step`` the loss (or ``None``)."""
    if datamodule is not None:
        source, owner = "the datamodule's train_dataloader()", datamodule
    elif isinstance(module, LightningModule) and is_overridden("train_dataloader", module):
        source, owner = "the model's train_dataloader()", module
    else:
        return None
    if batch_size is not None and isinstance(getattr(owner, "batch_size", None), int):
        owner.batch_size = batch_size
    try:
        loader = owner.train_dataloader()
        batch, what, unseen = batch_to_trace(loader, next(iter(loader)))
        batch = _on_host(batch, module)
    except Exception as error:  # noqa: BLE001 - the user's loader failed: say where, and what else works
        failed = f"{type(error).__name__}: {error}"
        if datamodule is not None:
            raise UsageError(f"{source} of `--datamodule`={type(datamodule).__name__} raised {failed}") from None
        why = f"train_dataloader() failed with a Trainer attached ({failed}); using example_input_array or --input-size instead"
        setup.notes.append(why)
        return None
    loaded = batch_samples(batch)
    if batch_size is not None and loaded is not None and loaded != batch_size:
        batch = sliced_batch(batch, loaded, batch_size)
        setup.notes.append(f"the dataloader gives batches of {loaded}; its samples are repeated to make {batch_size}")
    setup.batch_source = source
    example = getattr(module, "example_input_array", None)
    forward_input = _on_host(example, module) if example is not None else _first_tensor(batch)
    if isinstance(forward_input, dict):
        forward_input = None  # a dict batch is not forward's keyword arguments: no torchinfo summary without
        setup.notes.append("no torchinfo summary: the batch is a dict and the model has no example_input_array")
    if is_overridden("training_step", module) and module.automatic_optimization:
        setup.loss = "the model's training_step()"
        return batch, loss_function(module), forward_input, (what, unseen)
    return batch, _stand_in_loss_fn(module, setup, forward_of=_first_tensor), forward_input, (what, unseen)


def _first_tensor(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor) else batch


def _on_host(data: Any, module: Any) -> Any:
    data = move_data_to_device(data, "cpu")
    bf16 = any(p.dtype == torch.bfloat16 for p in module.parameters() if p.is_floating_point())
    return HalfPrecision("bf16-true").convert_input(data) if bf16 else data


def _stand_in_loss_fn(module: Any, setup: EstimateSetup, forward_of: Callable = lambda b: b) -> Callable[[Any], Any]:
    """``batch -> sum of the means of forward's floating outputs``."""
    setup.loss = "stand-in: the mean of forward's output"
    note = "no training_step for this batch: the loss is a stand-in, the mean of forward's output; a real loss adds little (targets and a few scalars)"
    setup.notes.append(note)

    def loss_of(batch: Any) -> torch.Tensor:
        inputs = forward_of(batch)
        inputs = inputs if isinstance(inputs, (list, tuple, dict)) else (inputs,)
        output = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
        leaves = [leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
        if not leaves:
            raise TypeError("forward returned no floating-point tensor to take a stand-in loss of")
        return cast(torch.Tensor, sum(leaf.float().mean() for leaf in leaves))  # leaves is not empty: no 0

    return loss_of


def _optimizers(module: Any, choice: str, setup: EstimateSetup) -> list:
    """``--optimizer``'s (``auto``: ``configure_optimizers()`` as ``Trainer.fit`` builds it, else Adam)."""
    if choice == "auto" and isinstance(module, LightningModule) and is_overridden("configure_optimizers", module):
        try:
            optimizers, _ = compat.init_optimizers_and_lr_schedulers(module)
        except Exception as error:  # noqa: BLE001 - the user's configure_optimizers, or Lightning's checks of it
            why = f"configure_optimizers() of {type(module).__name__} raised {type(error).__name__}: {error} (with a CPU Trainer attached, max_steps={_TRAINER['max_steps']}); fix it, or estimate with one of ours: --optimizer adam|adamw|sgd|none."
            raise UsageError(why) from None
        optimizers = [optimizer for optimizer in optimizers if not isinstance(optimizer, compat.MockOptimizer)]
        setup.optimizer = f"{', '.join(type(o).__name__ for o in optimizers)} (configure_optimizers())"
        if not optimizers:
            setup.notes.append("configure_optimizers() returned no optimizer: estimating without optimizer state")
            setup.optimizer = "none (configure_optimizers() returned None)"
        elif len(optimizers) > 1:  # Lightning allows several only with manual optimization
            note = f"configure_optimizers() returned {len(optimizers)} optimizers: the training_step steps each of them"
            setup.notes.append(note)
        return optimizers
    if choice == "auto":
        setup.notes.append("the model defines no configure_optimizers(): estimating with Adam")
        choice = "adam"
    setup.optimizer = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD (momentum 0.9)", "none": "none"}[choice]
    params = [p for p in module.parameters() if p.requires_grad]
    if choice == "none" or not params:
        return []
    if choice == "sgd":
        return [torch.optim.SGD(params, lr=0.01, momentum=0.9)]
    return [(torch.optim.AdamW if choice == "adamw" else torch.optim.Adam)(params, lr=1e-3)]
