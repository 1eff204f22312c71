"""The private torch APIs: only `slipcache.torch_private` touches them, and training goes on without them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from slipcache import torch_private
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from tests.helpers import FailsInBackward

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "slipcache"
SIZES = [40, 7, 300, 3]
DIM = 4
APIS = ("graph_task_id", "queue_callback", "storage_alone")


class _EngineWithoutQueue:
    """torch's autograd engine without `queue_callback` (torch's own backward still runs through it)."""

    def __init__(self, engine: object) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> object:
        if name == "queue_callback":
            raise AttributeError(name)
        return getattr(self._engine, name)


def remove(monkeypatch: pytest.MonkeyPatch, api: str) -> None:
    """Make the torch internal behind `api` missing, as a torch without it would be."""
    if api == "queue_callback":
        engine = torch.autograd.Variable._execution_engine
        monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", _EngineWithoutQueue(engine))
    else:
        monkeypatch.delattr(torch._C, {"graph_task_id": "_current_graph_task_id"}.get(api, "_storage_Use_Count"))

def _private(name: str) -> bool:
    """A name torch keeps to itself: a leading underscore, not a dunder (`__version__` is public)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None where the chain does not start at a name."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None


def private_torch_uses(source: str) -> list[str]:
    """Where `source` reaches torch's internals: an import of a private torch module or name (`torch._utils`,
    `torch.distributed._shard`, `from torch.nn.modules.module import _IncompatibleKeys`), or a private
    attribute, or a `getattr` of one, of anything taken from torch or from `slipcache.torch_private`
    (`torch._C`, `dist._x`, `ShardedTensor._init_from_local_shards_and_global_metadata`)."""
    tree = ast.parse(source)
    found: list[str] = []
    roots: set[str] = set()  # local names bound to torch's modules and objects

    def from_torch(module: str) -> bool:
        return module == "torch" or module.startswith("torch.") or module == "slipcache.torch_private"

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if from_torch(alias.name):
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    roots.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and from_torch(node.module or ""):
            module = node.module or ""
            for alias in node.names:
                if any(_private(part) for part in module.split(".")) or _private(alias.name):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
                roots.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in roots and _private(node.attr):
                found.append(f"{node.lineno}: {'.'.join(chain)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = _chain(node.args[0]) if node.args else None
            name = node.args[1] if len(node.args) > 1 else None
            if target and target[0] in roots and isinstance(name, ast.Constant) and isinstance(name.value, str) \
                    and _private(name.value):
                found.append(f"{node.lineno}: {node.func.id}({'.'.join(target)}, {name.value!r})")
    return found


def test_no_other_module_touches_torch_internals() -> None:
    touching = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "torch_private.py" and (uses := private_torch_uses(path.read_text()))
    }
    assert touching == {}
    assert private_torch_uses((PACKAGE / "torch_private.py").read_text())  # the check finds what it looks for


@pytest.mark.parametrize(
    "source",
    [
        "import torch._dynamo",
        "import torch.distributed._shard.sharded_tensor as st",
        "from torch._utils import _rebuild_tensor_v2",
        "from torch.distributed._shard.sharded_tensor import ShardedTensor",
        "from torch.nn.modules.module import _IncompatibleKeys",
        "from torch import _C",
        "import torch\nx = torch._C._current_graph_task_id()",
        "import torch\nx = torch.autograd.Variable._execution_engine",
        "import torch.distributed as dist\ndist._world",
        "from torch import nn\nnn.Module._apply",
        "from slipcache.torch_private import ShardedTensor\nShardedTensor._init_from_local_shards_and_global_metadata",
        "import torch\ngetattr(torch, '_C')",
        "def f():\n    import torch\n    return torch._utils",
    ],
)
def test_the_check_finds_each_way_in(source: str) -> None:
    assert private_torch_uses(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nx = torch.__version__",
        "from torch import Tensor, nn\nnn.functional.relu",
        "import torchrec\ntorchrec._private",  # not torch
        "import torch\nclass A:\n    def f(self):\n        return self._x",
        "from slipcache.torch_private import storage_alone",
    ],
)
def test_the_check_leaves_public_use_alone(source: str) -> None:
    assert private_torch_uses(source) == []


def test_each_api_answers_with_torch_and_falls_back_without(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int | None] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            seen.append(torch_private.graph_task_id())
            seen.append(int(torch_private.queue_callback(lambda: seen.append(None))))
            return grad

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    task, queued, called_after = seen
    assert task is not None and task >= 0 and queued == 1 and called_after is None  # the callback ran
    assert torch_private.graph_task_id() == -1  # outside a backward pass
    assert not torch_private.queue_callback(lambda: None)
    shared = torch.zeros(3)
    assert torch_private.storage_alone(torch.zeros(3))
    view = shared[1:]
    assert not torch_private.storage_alone(shared) and view.numel() == 2

    for api in APIS:
        remove(monkeypatch, api)
    seen.clear()
    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [None, 0]  # no task id, nothing queued
    assert not torch_private.storage_alone(torch.zeros(3))  # cannot say: never "free"


def test_an_api_that_raises_counts_as_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> int:
        raise RuntimeError("changed in this torch")

    monkeypatch.setattr(torch._C, "_current_graph_task_id", refuse)
    monkeypatch.setattr(torch._C, "_storage_Use_Count", refuse)
    assert torch_private.graph_task_id() is None
    assert not torch_private.storage_alone(torch.zeros(3))


def train(
    optimizer: str, steps: int = 5, forwards: int = 1
) -> tuple[CachedEmbeddingBagCollection, list[torch.Tensor]]:
    """A few steps of `forwards` lookups each, one backward pass per step; (collection, outputs)."""
    config = EmbeddingConfig(SIZES, dim=DIM, precision="int8", optimizer=optimizer, cache_rows=24, ways=4, lr=0.1)
    coll = CachedEmbeddingBagCollection(config)
    g = torch.Generator().manual_seed(3)
    outputs = []
    for _ in range(steps):
        ids = [torch.stack([torch.randint(0, n, (16,), generator=g) for n in SIZES], dim=1) for _ in range(forwards)]
        outs = [coll(batch) for batch in ids]
        sum((out * torch.randn(out.shape, generator=g)).sum() for out in outs).backward()
        outputs += [out.detach().clone() for out in outs]
    return coll, outputs


def assert_same(a: tuple[CachedEmbeddingBagCollection, list], b: tuple[CachedEmbeddingBagCollection, list]) -> None:
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a[0].export_tables(), b[0].export_tables(), strict=True):
        assert torch.equal(x, y)
    assert a[0].stats() == b[0].stats()


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("missing", [*APIS, "all"])
def test_training_without_a_private_api_equals_training_with_it(
    optimizer: str, missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = train(optimizer)
    for api in APIS if missing == "all" else [missing]:
        remove(monkeypatch, api)
    assert_same(train(optimizer), reference)


@pytest.mark.parametrize("missing", ["graph_task_id", "storage_alone"])
def test_several_forwards_take_one_step_per_row_without_the_task_id_or_the_use_count(
    missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only `queue_callback` gathers a backward pass's gradients into one step (Adagrad shows the difference)."""
    reference = train("adagrad", forwards=2)
    remove(monkeypatch, missing)
    assert_same(train("adagrad", forwards=2), reference)


def test_without_the_use_count_step_buffers_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    def rows_buffers(coll: CachedEmbeddingBagCollection) -> set[int]:
        seen = set()
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            coll(torch.stack([torch.randint(0, n, (16,), generator=g) for n in SIZES], dim=1)).sum().backward()
            seen.add(id(coll.scratch.buffers["rows"]))
        return seen

    config = EmbeddingConfig(SIZES, dim=DIM, precision="fp32", cache_rows=24)
    assert len(rows_buffers(CachedEmbeddingBagCollection(config))) == 1
    remove(monkeypatch, "storage_alone")
    assert len(rows_buffers(CachedEmbeddingBagCollection(config))) == 3


@pytest.mark.parametrize("missing", ["graph_task_id", "queue_callback"])
def test_without_the_api_a_failed_backward_passes_gradients_are_applied(
    missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With torch's internals the failed pass's gradients are dropped (embedding/test_steps); without the task
    id they join the next pass's step, without the callback they were applied as they came: training goes on."""
    remove(monkeypatch, missing)
    config = EmbeddingConfig(SIZES, dim=DIM, precision="fp32", cache_rows=20, lr=0.05)
    aborted, plain, dropped = (CachedEmbeddingBagCollection(config) for _ in range(3))
    g = torch.Generator().manual_seed(1)
    first, second = (torch.stack([torch.randint(0, n, (24,), generator=g) for n in SIZES], dim=1) for _ in range(2))
    failing = FailsInBackward.apply(torch.ones(1, requires_grad=True))  # runs after the lookup's backward
    out = aborted(first)
    with pytest.raises(RuntimeError, match="boom"):
        (out.sum() + failing.sum()).backward()
    aborted(second).sum().backward()
    if missing == "graph_task_id":  # both gradients in one step (the engine hands them over in another order)
        (plain(first).sum() + plain(second).sum()).backward()
    else:  # two steps
        plain(first).sum().backward()
        plain(second).sum().backward()
    dropped(first)  # what torch's internals give: the failed pass's gradients dropped
    dropped(second).sum().backward()
    ours, applied, without = (torch.cat(c.export_tables()) for c in (aborted, plain, dropped))
    torch.testing.assert_close(ours, applied, rtol=0, atol=1e-6)
    assert (ours - without).abs().max() > 0.01
    assert not aborted.optimizer._pending
