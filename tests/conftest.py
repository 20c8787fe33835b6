import pytest
import torch


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
