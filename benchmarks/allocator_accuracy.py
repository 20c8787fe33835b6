"""Memory counted at the allocator: our meters against the torch profiler's allocator events.

For each model x batch size, one steady-state training step (Adam state alive) is measured four ways:

* **truth**: the torch profiler's allocation events (``profile_memory=True``), summed in order over
  the step, plus the storages alive before it (model, gradients, optimizer state, batch);
* **storages only**: a ``LiveTensorTracker(workspaces=False)``: live tensor storages at the
  dispatcher (what ``MemoryBudget`` counted before it learned op workspaces);
* **allocator level**: ``LiveTensorTracker()`` / ``MemoryBudget``: storages plus each op's in-kernel
  workspace, learned from the profiler op by op;
* **simulated H100**: ``SimulatedGpu("H100")``'s allocated and reserved peaks (512-byte blocks,
  segments and cached blocks of the caching-allocator model; cuBLAS workspace left out here so the
  figures compare with the host's).

The U-Net and the decoder are held-out shapes (not used when the meters were written). A dated
section is appended to ``benchmarks/RESULTS.md`` (``--no-write`` skips it).

Usage::

    .venv/bin/python benchmarks/allocator_accuracy.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from _common import append
from lightning_gpuopt.core.memory import LiveTensorTracker, storage_bytes
from lightning_gpuopt.testing import SimulatedGpu


class Block(nn.Module):
    def __init__(self, width: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (part.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for part in self.qkv(self.norm1(x)).split(c, dim=2))  # fmt: skip
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embedding(tokens)))


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.out = nn.Conv2d(32, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down1(x)
        return self.out(torch.cat([skip, self.up(self.down2(skip))], dim=1))


def models(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    mha = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, batch_first=True), 2,
                                enable_nested_tensor=False)  # fmt: skip
    return {
        "MLP": (nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)),
                torch.randn(batch_size, 512, generator=g), lambda out, x: out.pow(2).mean()),
        "CNN + BatchNorm": (nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                          nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)),
                            torch.randn(batch_size, 3, 32, 32, generator=g), lambda out, x: out.pow(2).mean()),
        "Transformer (MHA)": (mha, torch.randn(batch_size, 64, 128, generator=g), lambda out, x: out.pow(2).mean()),
        "decoder (SDPA), held out": (Decoder(), torch.randint(0, 512, (batch_size, 128), generator=g),
                                     lambda out, x: F.cross_entropy(out.flatten(0, 1), x.flatten())),
        "U-Net, held out": (UNet(), torch.randn(batch_size, 3, 64, 64, generator=g), lambda out, x: F.mse_loss(out, x)),
    }  # fmt: skip


def profiler_peak(step, existing) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []

    def walk(event) -> None:
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return storage_bytes(*existing) + peak


def measure(name: str, network: nn.Module, x: torch.Tensor, loss_fn) -> dict:
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(network.parameters())

    def step() -> None:
        loss_fn(network(x), x).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    existing = (network, optimizer, x)
    truth = profiler_peak(step, existing)
    with LiveTensorTracker(existing=existing, workspaces=False) as storages:
        step()
    with LiveTensorTracker(existing=existing) as allocator:
        step()
    with SimulatedGpu("H100", cublas_workspace=0) as gpu:
        gpu.place(*existing)
        with gpu.device.peak_meter() as card:
            step()
    return {"truth": truth, "storages": storages.peak_bytes, "allocator": allocator.peak_bytes,
            "card": card.peak_bytes, "reserved": card.peak_reserved_bytes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = ["| model | batch | truth (profiler) | storages only | allocator level | simulated H100 allocated | "
            "simulated H100 reserved |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    worst = 0.0
    for batch_size in args.batch_sizes:
        for name, (network, x, loss_fn) in models(batch_size).items():
            m = measure(name, network, x, loss_fn)
            err = {key: (m[key] - m["truth"]) / m["truth"] for key in ("storages", "allocator", "card", "reserved")}
            worst = max(worst, abs(err["allocator"]))
            rows.append(f"| {name} | {batch_size} | {m['truth'] / 2**20:.2f} MiB | {err['storages']:+.2%} | "
                        f"{err['allocator']:+.2%} | {err['card']:+.2%} | {err['reserved']:+.2%} |")  # fmt: skip
    table = "\n".join(rows)
    notes = (f"Errors are (meter - truth) / truth over one steady-state step (Adam). Worst allocator-level error: "
             f"{worst:.2%}. Wall time: {time.perf_counter() - started:.0f} s.")  # fmt: skip
    print(table)
    print(notes)
    if not args.no_write:
        append("Allocator-level memory vs the torch profiler", table, notes)


if __name__ == "__main__":
    main()
