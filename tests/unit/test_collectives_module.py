"""Every torch.distributed collective of the package goes through megatron_pack/parallel/comm.py.

An AST scan of the package fails on a collective named anywhere else (called, or passed around as
``dist.barrier``); comm's backend -> device mapping is checked with a fake group backend; a spawned
gloo world reduces a float64 step outcome through it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from megatron_pack.parallel import comm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _dist import spawn_world  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_pack"

COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "_all_gather_base",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp",
})
"""torch.distributed's collectives and point-to-point calls."""

HOME = "parallel/comm.py"
EXEMPT: set[str] = set()
"""None: even the CPU accommodation of megatron-core's collectives (model/cpu_compat.py) goes through HOME."""


def _dist_aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """(names bound to the torch.distributed module, {local name: collective} imported from it)."""
    modules, functions = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
            if node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                functions.update({a.asname or a.name: a.name for a in node.names if a.name in COLLECTIVES})
    return modules, functions


def _is_dist_module(node: ast.AST, modules: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in modules
    # torch.distributed, with torch imported as itself
    return (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


def collectives_named(source: str) -> list[tuple[int, str]]:
    """(line, name) of every torch.distributed collective ``source`` names: ``dist.all_reduce(...)``,
    ``torch.distributed.barrier``, ``getattr(dist, "reduce_scatter_single")``, or an imported name."""
    tree = ast.parse(source)
    modules, functions = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and _is_dist_module(node.value, modules):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in functions and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, functions[node.id]))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and _is_dist_module(node.args[0], modules)
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLECTIVES):
            found.append((node.lineno, node.args[1].value))
    return sorted(found)


SCANNER_CASES = [
    ("alias-call", "import torch.distributed as dist\ndist.all_reduce(t)\n", [(2, "all_reduce")]),
    ("full-path", "import torch\ntorch.distributed.barrier()\n", [(2, "barrier")]),
    ("passed-around", "import torch.distributed as dist\nf = dist.barrier\n", [(2, "barrier")]),
    ("from-import", "from torch.distributed import all_gather as ag\nag(x, t)\n", [(2, "all_gather")]),
    ("from-torch", "from torch import distributed as d\nd.broadcast(t, 0)\n", [(2, "broadcast")]),
    ("getattr", "import torch.distributed as dist\ng = getattr(dist, 'reduce_scatter_single')\n",
     [(2, "reduce_scatter_single")]),
    ("not-a-collective", "import torch.distributed as dist\ndist.get_rank(); group.size()\n", []),
    ("other-module", "import mylib as dist2\ndist2.all_reduce(t)\n", []),
]


@pytest.mark.parametrize("source,expected", [c[1:] for c in SCANNER_CASES], ids=[c[0] for c in SCANNER_CASES])
def test_scanner_finds_collectives(source, expected):
    assert collectives_named(source) == expected


def test_no_collective_outside_the_comm_module():
    files = {p.relative_to(PACKAGE).as_posix(): p for p in PACKAGE.rglob("*.py")}
    outside = [f"megatron_pack/{rel}:{line}: torch.distributed.{name}"
               for rel, path in sorted(files.items()) if rel != HOME and rel not in EXEMPT
               for line, name in collectives_named(path.read_text(encoding="utf-8"))]
    assert not outside, "collectives outside megatron_pack/parallel/comm.py (call its functions):\n" + "\n".join(outside)
    # not vacuous: the scan reads the package, and it sees the collectives where they are
    assert len(files) > 50
    assert len(collectives_named(files[HOME].read_text(encoding="utf-8"))) >= 8


class _FakeGroup:
    """Stands in for a process group of another backend (only the backend is asked)."""


@pytest.mark.parametrize("backend,expected", [("gloo", "cpu"), ("GLOO", "cpu"), ("nccl", "cuda:3"), ("mpi", "cpu")],
                         ids=["gloo", "gloo-upper", "nccl", "other"])
def test_backend_device_mapping(monkeypatch, backend, expected):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: backend)
    assert str(comm.device_for_backend(backend)) == expected
    assert str(comm.comm_device(_FakeGroup())) == expected


def test_tensors_go_to_the_groups_device_and_back(monkeypatch):
    """A CPU float64 vector over an 'nccl' group is reduced on that group's device and copied back into the
    caller's CPU tensor (a meta device stands in for the GPU: the collective sees it, the caller never does)."""
    seen, copied = [], []
    monkeypatch.setattr(comm, "group_size", lambda group: 2)
    monkeypatch.setattr(comm, "comm_device", lambda group: torch.device("meta"))
    monkeypatch.setattr(comm.dist, "all_reduce", lambda tensor, op=None, group=None: seen.append(
        (tensor.device.type, tensor.dtype, op)))
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src: copied.append((self.device.type, src.device.type)))
    vec = torch.tensor([1.5, 2.0], dtype=torch.float64)
    out = comm.all_reduce(vec, group=_FakeGroup(), op="max")
    assert seen == [("meta", torch.float64, torch.distributed.ReduceOp.MAX)]
    assert copied == [("cpu", "meta")] and out is vec and vec.device.type == "cpu"


def test_a_tensor_already_on_the_groups_device_is_not_copied(monkeypatch):
    monkeypatch.setattr(comm, "group_size", lambda group: 2)
    monkeypatch.setattr(comm, "comm_device", lambda group: torch.device("cpu"))
    wires = []
    monkeypatch.setattr(comm.dist, "all_reduce", lambda tensor, op=None, group=None: wires.append(tensor))
    vec = torch.tensor([1.0])
    assert comm.all_reduce(vec, group=_FakeGroup()) is vec and wires == [vec] and wires[0] is vec


def test_a_group_of_one_is_a_no_op():
    vec = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert not torch.distributed.is_initialized()
    assert comm.all_reduce(vec) is vec and comm.all_gather(vec) == [vec]
    assert comm.all_gather_object({"a": 1}) == [{"a": 1}] and comm.broadcast_objects([3], src=0) == [3]


def _reference_outcome(rank: int, fails: bool) -> dict:
    """verify's agreement on rank 0's transformers load: every rank ends together, rank 0 with the line."""
    from megatron_pack.cli.verify import VerifyStopped, agree_on_reference

    def load():
        if fails:
            raise OSError("Error no file named pytorch_model.bin, model.safetensors found in directory /x\nmore")
        return "reference"

    try:
        return {"returned": str(agree_on_reference(load, holder=rank == 0, what="model.pretrained (/x)")), "line": ""}
    except VerifyStopped as exc:
        return {"returned": "stopped", "line": exc.line or ""}


def _world_worker(rank: int, world_size: int) -> dict:
    from megatron_pack.parallel.comm import all_gather, all_reduce, broadcast
    from megatron_pack.training.outcome import reduce_outcome

    class Pack:
        def __init__(self, n):
            self.real_tokens, self.slots, self.sample_ids, self.bucket = n, 16, [rank, n], 0

    # float64 sums that float32 would round: 2**40 + rank + 0.25
    reports = [{"lm loss": torch.tensor([2.0 ** 40 + rank + 0.25, 3.0 + rank], dtype=torch.float64),
                "extra": torch.tensor([0.5 * (rank + 1)], dtype=torch.float64)}]
    outcome = reduce_outcome(reports, [Pack(10 + rank)], num_buckets=1, num_sources=0, owns_packs=True,
                             group=torch.distributed.group.WORLD, sum_sq=[9 + 16 * rank])
    mx = all_reduce(torch.tensor([float(rank)]), op="max")
    b = broadcast(torch.tensor([float(rank + 7)]), src=1)
    gathered = torch.cat(all_gather(torch.tensor([rank], dtype=torch.float64)))
    failed, loaded = _reference_outcome(rank, fails=True), _reference_outcome(rank, fails=False)
    return {"loss_sum": outcome.counts.loss_sum, "target": outcome.counts.target_tokens,
            "real": outcome.counts.real_tokens, "local": outcome.local_target_tokens,
            "extra": outcome.reports["extra"][0], "sum_sq": outcome.counts.sum_sq_seqlens, "max": float(mx), "bcast": float(b), "gathered": gathered.numpy(),
            "failed_returned": failed["returned"], "failed_line": failed["line"], "loaded": loaded["returned"]}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One 2-rank gloo world for the checks below (each new world costs 10-40 s on CI)."""
    return spawn_world(_world_worker, 2, tmp_path_factory.mktemp("comm"), timeout_s=120)


def test_float64_outcome_reduction_through_comm_on_gloo(world):
    for r in world:
        assert float(r["loss_sum"]) == 2.0 ** 41 + 1.5  # exact in float64, not in float32
        assert float(r["target"]) == 7.0 and int(r["real"]) == 21 and float(r["extra"]) == 1.5
        assert float(r["sum_sq"]) == 34.0  # the FLOPs' attention term rides the same reduction
        assert float(r["max"]) == 1.0 and float(r["bcast"]) == 8.0 and r["gathered"].tolist() == [0.0, 1.0]
    assert [int(r["local"]) for r in world] == [3, 4]  # each rank keeps its own count


def test_verify_reference_load_failure_ends_every_rank_with_one_line(world):
    """Rank 0 cannot load transformers' model: both ranks stop at once (no wait in the logits all-gather);
    only rank 0 has a line, and it names the key, the folder and the fix."""
    assert [str(r["failed_returned"]) for r in world] == ["stopped", "stopped"]
    line = str(world[0]["failed_line"])
    assert line.startswith("verify.reference=transformers: transformers could not load model.pretrained (/x) "
                           "(OSError: Error no file named") and "verify.reference=self" in line and "\n" not in line
    assert str(world[1]["failed_line"]) == ""
    assert [str(r["loaded"]) for r in world] == ["reference", "None"]  # the load that works: rank 0 holds it
