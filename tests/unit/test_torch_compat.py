"""Every torch internal of ``lightning_gpuopt.core._torch_compat`` works on the installed torch; a failure
names the internal and the torch version, so a release that moves one is caught here, not deep in a trace."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_gpuopt.core import _torch_compat as compat


def _fails(internal: str) -> str:
    return f"torch {torch.__version__} moved or changed `{internal}`: update lightning_gpuopt/core/_torch_compat.py"


def test_pytree_flattens_nested_collections():
    tree = {"a": [torch.ones(1), (2, torch.zeros(2))]}
    assert len([leaf for leaf in compat.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]) == 2, _fails(
        "torch.utils._pytree.tree_leaves"
    )
    assert compat.tree_map(lambda x: x * 2 if isinstance(x, int) else x, tree)["a"][1][0] == 4, _fails("tree_map")
    leaves, _ = compat.tree_flatten(tree)
    assert len(leaves) == 3, _fails("torch.utils._pytree.tree_flatten")


def test_fake_tensors_allocate_nothing_and_keep_shapes():
    with compat.FakeTensorMode() as mode:
        fake = torch.empty(1000, 1000)
    assert isinstance(fake, compat.FakeTensor) and fake.shape == (1000, 1000), _fails("torch._subclasses.fake_tensor")
    assert mode is not None


def test_dispatch_mode_sees_ops_and_is_the_current_one():
    seen = []

    class Seen(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            assert compat.current_dispatch_mode() is None, _fails("_get_current_dispatch_mode (inside a mode)")
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2) + 1
    assert any("add" in name for name in seen), _fails("torch.utils._python_dispatch.TorchDispatchMode")


def test_storage_key_is_shared_by_views_only():
    base, other = torch.zeros(4), torch.zeros(4)
    assert compat.storage_key(base[1:].untyped_storage()) == compat.storage_key(base.untyped_storage()), _fails(
        "UntypedStorage._cdata"
    )
    assert compat.storage_key(other.untyped_storage()) != compat.storage_key(base.untyped_storage())


def test_legacy_profiler_records_the_allocators_events():
    assert not compat.profiler_running(), _fails("torch.autograd._profiler_enabled")
    compat.start_allocation_events()
    try:
        assert compat.profiler_running()
        keep = torch.zeros(1000)
    finally:
        records = compat.stop_allocation_events()
    sizes = [int(r.cpu_memory_usage()) for thread in records for r in thread if r.kind() == "memory_alloc"]
    assert 4000 in sizes, _fails("torch.autograd._enable_profiler_legacy / memory_alloc records")
    del keep


@pytest.mark.parametrize("device", ["cpu"])
def test_grad_scale_is_the_scalers_tensor(device):
    scaler = torch.amp.GradScaler(device, init_scale=8.0)
    scaler.scale(torch.ones(1))
    assert float(compat.grad_scale(scaler)) == 8.0, _fails("GradScaler._scale")


def test_in_backward_is_true_inside_autograds_engine_only():
    from lightning_gpuopt.core._torch_compat import in_backward

    x, seen = torch.ones(3, requires_grad=True), []
    x.register_hook(lambda grad: seen.append(in_backward()))
    (x * 2).sum().backward()
    assert seen == [True] and not in_backward()


def test_eager_runs_compiled_code_eager_and_leaves_dynamos_caches_alone():
    graphs: list = []

    def counting(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() + 1, backend=counting)
    with compat.eager(), compat.FakeTensorMode():  # a dispatch mode would mark the frame eager for good
        compiled(torch.ones(2))
    assert not graphs, _fails("torch.compiler.set_stance('force_eager')")
    compiled(torch.ones(2))
    assert len(graphs) == 1
    torch._dynamo.reset()


def test_a_loader_without_workers_fetches_through_the_single_process_iterator():
    loader = torch.utils.data.DataLoader(torch.arange(6), batch_size=3)
    iterator = iter(loader)
    assert isinstance(iterator, compat.single_process_loader_iterator()), _fails("_SingleProcessDataLoaderIter")
    assert iterator._next_data().tolist() == [0, 1, 2], _fails("_SingleProcessDataLoaderIter._next_data")
