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
