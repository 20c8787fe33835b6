"""The suite, in groups a newcomer can run alone (``pytest -m unit``, ``tests/unit``):

* ``unit/`` -- no Trainer: core decisions, memory accounting, the simulated card, argument checks, the
  house rules (seconds);
* ``integration/`` -- real CPU Trainers: every callback, preset and CLI, users' models, leaving no trace;
* ``ddp/`` -- 2 CPU processes (gloo) launched as users launch them;
* ``gpu/`` -- the CUDA paths, skipped without a card (``make test-gpu``).

The support modules (``helpers``, the model zoos, the DDP script) live beside this file; it puts this
folder on ``sys.path`` so every group imports them by name.
"""

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
GROUPS = ("unit", "integration", "ddp", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test is marked with its folder's group; the doctests of the package are unit tests."""
    for item in items:
        relative = Path(str(item.fspath)).resolve()
        group = next((g for g in GROUPS if (TESTS / g) in relative.parents), "unit")
        item.add_marker(getattr(pytest.mark, group))


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    """The tests measure timing logic, not matrix throughput: with one intra-op thread a loaded
    2-core machine cannot stall OpenMP regions (a tiny MLP step went from 0.3 ms to 135 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def memory_url(tmp_path, monkeypatch):
    """A fresh ``memory://gpuopt-test-<unique>`` folder of fsspec's in-memory filesystem, with the test
    run from ``tmp_path`` (so that a URL mangled into a local path, ``memory:/...``, lands there and
    can be looked for); what the test wrote there is removed afterwards."""
    import uuid

    import fsspec

    monkeypatch.chdir(tmp_path)
    name = f"gpuopt-test-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    for key in [key for key in fs.store if key.startswith(f"/{name}")]:
        del fs.store[key]
    fs.pseudo_dirs[:] = [folder for folder in fs.pseudo_dirs if not folder.startswith(f"/{name}")]
