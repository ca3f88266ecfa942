"""megatron-core on a machine without CUDA: the one place that accommodates its device assumptions.

megatron-core 0.16.1 assumes a GPU in these places the CPU path reaches:

1. ``torch.cuda.current_device()`` names the device of new tensors (RoPE frequencies, TP
   collective buffers, its DDP grad buffers). Without CUDA that call raises; here it answers
   ``"cpu"``, a valid ``device=`` argument, so those tensors land on the CPU.
2. Its RNG tracker (``get_cuda_rng_tracker()``, forked around dropout in TP / sequence-parallel
   regions, e.g. the embedding under sequence parallelism) saves and restores *CUDA* generator
   states. ``CpuRNGStatesTracker`` keeps the same named streams as CPU generator states, so
   ``model_parallel_cuda_manual_seed`` and ``fork()`` work unchanged.

3. Activation recomputation (``tensor_parallel.checkpoint``, used by ``model.recompute_granularity``)
   saves and restores the *CUDA* default generator around the recomputed forward. On CPU the
   CPU generator (which it saves too) and the tracker's streams are the whole RNG state, so the
   CUDA part is an empty placeholder here.

4. At import, megatron-core decorates its fused kernels (``fusions/``) with ``jit_fuser``, which is
   ``torch.compile``: that imports TorchDynamo and Inductor, about half of megatron-core's import
   time (1-4 s here, before step 1 of every worker). The CPU path never calls those kernels (the
   fusions are on only with CUDA, ``builder.py``), so ``eager_jit_fuser_without_cuda()``, called
   before megatron-core is first imported (by the ``train``, ``verify`` and ``export`` entries), makes ``jit_fuser`` the no-op decorator megatron-core
   itself has (``megatron.core.jit.noop_decorator``).

5. With pipeline stages and tied embeddings, the last stage's copy of the embedding is filled from
   the first stage's by ``LanguageModule.setup_embeddings_and_output_layer``, which moves it with
   ``weight.data.cuda()`` before the all-reduce. On CPU that move is the identity (the weight stays
   where the model is built); the all-reduce itself runs on gloo unchanged.

6. megatron-core's all-to-all MoE dispatcher (the one dispatcher, on every device) copies its split sizes
   device-to-host on a side CUDA stream it creates at construction (``cuda_dtoh_stream``) and waits on an
   event before the exchange. On CPU the split sizes are host tensors already: ``_dtoh_without_streams``
   turns them into the numpy arrays the GPU path hands ``all_to_all`` at the same point, with no stream, and
   the class's stream slot holds a placeholder so construction creates none. gloo has ``all_to_all_single``
   with unequal splits, so the exchange itself runs unchanged.

7. With expert tensor parallelism that dispatcher gathers (and reduce-scatters back) each expert-TP rank's
   routed tokens, counts that differ by rank, through ``torch.distributed.all_gather`` /
   ``reduce_scatter`` on lists of unequal pieces, which gloo refuses. On CPU megatron-core's two helpers
   take such split sizes through ``_gather_unequal`` / ``_reduce_scatter_unequal``: every piece padded to
   the largest, the equal collective gloo has, the padding cut off (the same sums, so the same gradients:
   megatron-core's autograd functions call these helpers both ways). Equal splits run megatron-core's own.

8. megatron-core's schedules (``get_forward_backward_func``: no pipelining, 1F1B, interleaved) and its
   ``P2PCommunicator`` make their token counter with ``torch.zeros(..., device="cuda")`` and call
   ``torch.cuda.synchronize()`` after the shape exchange of variable-length packs. While one of the
   three schedules runs, ``CudaAsCpu`` (a ``TorchFunctionMode``) maps a CUDA ``device=`` argument (and
   ``Tensor.cuda`` / ``Tensor.to("cuda")``) to the CPU; ``torch.cuda.synchronize`` is a no-op (CPU work
   is synchronous). gloo has no coalesced ``batch_isend_irecv``, so the model config keeps
   ``batch_p2p_comm=False`` on every device (the communicator then posts plain ``isend`` / ``irecv``).
   The mode is on only inside the schedule call, and off again inside its ``forward_step_func`` (the
   model's forward makes no CUDA tensors, and a mode costs a Python call per torch op).

9. megatron-core's optimizer (``get_megatron_optimizer``: the plain one and the distributed one) keeps
   its loss scale and found-inf flag on ``device="cuda"`` and asserts that parameters and gradients are
   ``torch.cuda.*Tensor`` types. Its construction and its ``step`` run under ``CudaAsCpu`` too (where
   ``Tensor.type()`` names a CPU tensor's CUDA type), so the GPU's optimizer object is built and stepped
   on a CPU (without Transformer Engine and apex megatron-core falls back to ``torch.optim.AdamW``).

gloo on torch >= 2.4 already has the ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
collectives megatron-core uses for sequence parallelism, so nothing is needed for them.

The entry points (``megatron-pack train`` / ``verify``) call ``enable_cpu_compat_without_cuda()``
before they start process groups, and ``megatron_pack.model.builder.build_model`` calls it too, so
no model is built without it. Nothing else imports this module (at import it imports nothing of the
package: a leaf; the two gloo collectives of item 7 go through ``parallel/comm.py`` when they run). ``enable_cpu_compat()`` refuses to run when CUDA is present, so the GPU path
never goes through here. Both are idempotent.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False


def _cpu_current_device() -> str:
    return "cpu"


def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron-core's named RNG streams, kept as CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added; call model_parallel_cuda_manual_seed first")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    return CpuRNGStatesTracker


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _without_cuda_moves(method):
    """``method`` with ``Tensor.cuda`` the identity while it runs (item 5)."""

    def wrapped(self, *args, **kwargs):
        move = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = move

    wrapped.__wrapped__ = method
    return wrapped


def _dtoh_without_streams(self, point: str, tokens_per_expert=None):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on CPU (item 6): at the dispatcher's
    device-to-host point the split sizes become numpy arrays (as its GPU copies do); nothing to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _gather_unequal(original):
    """megatron-core's ``_gather_along_first_dim`` with unequal ``output_split_sizes`` on gloo (item 7).

    Example, 2 ranks, splits [3, 1]: each pads its rows to 3, the equal all-gather gives 6 rows, and rows
    0-2 and 3 (of rank 1's padded 3-5) are kept: the 4 rows in rank order.
    """

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        from megatron_pack.parallel.comm import all_gather_into_tensor

        out = all_gather_into_tensor(padded, group)
        return torch.cat([out[r * longest:r * longest + n] for r, n in enumerate(sizes)])

    return gather


def _reduce_scatter_unequal(original):
    """megatron-core's ``_reduce_scatter_along_first_dim`` with unequal ``input_split_sizes`` on gloo (item 7):
    each rank's piece ``r`` padded to the largest, the equal reduce-scatter, rank ``r``'s padding cut off."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest * len(sizes), *input_.shape[1:]))
        for r, piece in enumerate(torch.split(input_, sizes, dim=0)):
            padded[r * longest:r * longest + piece.shape[0]] = piece
        from megatron_pack.parallel.comm import reduce_scatter_tensor

        out = reduce_scatter_tensor(padded, group)
        return out[:sizes[group.rank()]]

    return reduce_scatter


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class CudaAsCpu(TorchFunctionMode):
    """Tensors megatron-core asks for on ``"cuda"`` are made on the CPU (item 8)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # asked to check: "is it on the GPU?"
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and any(_is_cuda(a) for a in args[1:]):
            args = tuple("cpu" if i and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def _outside_mode(func):
    """``func`` run with the innermost ``TorchFunctionMode`` (the ``CudaAsCpu`` of the schedule) off: the
    model's forward runs at full speed (a mode costs a Python call per torch op), its tensors on the CPU."""

    @functools.wraps(func)
    def run(*args, **kwargs):
        mode = torch._C._pop_torch_function_stack()
        try:
            return func(*args, **kwargs)
        finally:
            torch._C._push_on_torch_function_stack(mode)

    return run


def _cuda_as_cpu(schedule):
    """``schedule`` (one of megatron-core's forward-backward functions, or its optimizer's construction or
    step) run under ``CudaAsCpu``; a schedule's ``forward_step_func`` runs outside it."""

    @functools.wraps(schedule)
    def wrapped(*args, **kwargs):
        if "forward_step_func" in kwargs:
            kwargs = {**kwargs, "forward_step_func": _outside_mode(kwargs["forward_step_func"])}
        with CudaAsCpu():
            return schedule(*args, **kwargs)

    return wrapped


_SCHEDULES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
              "forward_backward_pipelining_with_interleaving")
"""megatron-core's schedules, which ``get_forward_backward_func`` picks by module global at call time."""


def _no_synchronize(*args, **kwargs) -> None:
    return None


def _schedules_on_cpu() -> None:
    from megatron.core.pipeline_parallel import schedules

    for name in _SCHEDULES:
        setattr(schedules, name, _cuda_as_cpu(getattr(schedules, name)))
    torch.cuda.synchronize = _no_synchronize


def _optimizer_on_cpu() -> None:
    """Item 9: ``get_megatron_optimizer`` and every megatron-core optimizer class's own ``step``."""
    import megatron.core.optimizer as moptim
    from megatron.core.optimizer import distrib_optimizer, optimizer

    moptim.get_megatron_optimizer = _cuda_as_cpu(moptim.get_megatron_optimizer)
    classes = {cls for module in (optimizer, distrib_optimizer) for cls in vars(module).values()
               if isinstance(cls, type) and issubclass(cls, optimizer.MegatronOptimizer)}
    for cls in classes:
        if "step" in vars(cls):
            cls.step = _cuda_as_cpu(vars(cls)["step"])


def enable_cpu_compat() -> None:
    """Install the CPU answers to megatron-core's CUDA assumptions (hosts without CUDA only)."""
    global _ENABLED
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_compat() is for hosts without CUDA; the GPU path must not use it.")
    if _ENABLED:
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = _cpu_current_device
    mrandom._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_no_cuda_rng_state
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _without_cuda_moves(
        LanguageModule.setup_embeddings_and_output_layer)
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on this host"
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _dtoh_without_streams
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _gather_unequal(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_unequal(mappings._reduce_scatter_along_first_dim)
    _schedules_on_cpu()
    _optimizer_on_cpu()
    _ENABLED = True


def enable_cpu_compat_without_cuda() -> bool:
    """``enable_cpu_compat()`` when this host has no CUDA (what an entry point calls); True when it is on."""
    if torch.cuda.is_available():
        return False
    enable_cpu_compat()
    return True


def eager_jit_fuser_without_cuda() -> bool:
    """Before megatron-core's first import on a host without CUDA: ``megatron.core.jit`` with
    ``jit_fuser`` = the no-op decorator (item 4 of the module docstring); the same four names as
    megatron-core's module, ``enable_jit_fuser()`` still switching to ``torch.compile``. True when done."""
    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        return False
    jit = types.ModuleType("megatron.core.jit", "megatron-core's jit_fuser, eager on a host without CUDA "
                                                "(megatron_pack.model.cpu_compat).")

    def noop_decorator(func):
        return func

    def enable_jit_fuser() -> None:
        jit.jit_fuser = torch.compile

    def disable_jit_fuser() -> None:
        jit.jit_fuser = noop_decorator

    jit.__dict__.update(torch=torch, jit_fuser=noop_decorator, noop_decorator=noop_decorator,
                        enable_jit_fuser=enable_jit_fuser, disable_jit_fuser=disable_jit_fuser)
    sys.modules["megatron.core.jit"] = jit
    return True


def cpu_compat_enabled() -> bool:
    """True once ``enable_cpu_compat()`` has run in this process."""
    return _ENABLED
