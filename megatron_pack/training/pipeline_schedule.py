"""One step's micro-batches through a pipeline: the 1F1B schedule over point-to-point sends.

On GPU this is megatron-core's ``forward_backward_pipelining_without_interleaving``; megatron-core
0.16.1's schedules create CUDA tensors (``total_num_tokens`` on ``device="cuda"``), so on CPU
:func:`forward_backward_1f1b` runs the same schedule over ``parallel.pipeline.StageLink`` (gloo),
with the same numerics:

* stage ``s`` of ``P`` runs ``min(P - s - 1, M)`` warm-up forwards, then alternates one forward
  and one backward, then the cool-down backwards (at most ``P - s`` activations alive at once);
* ``forward_step_func(data_iterator, model)`` runs on every stage (each reads its own copy of
  the pack for its boundaries); the stage's input is set with ``set_input_tensor``;
* the last stage applies the loss function: backward runs on the micro-batch's loss SUM (per-token
  loss; without it, on the sum / target count / ``num_microbatches``, as megatron-core does);
* the other stages backpropagate the gradient received from the next stage and send their
  input's gradient back;
* gradient sync is deferred to the last backward (``no_sync``), and the target tokens are
  counted on the last stage: ``finalize_model_grads`` broadcasts that count over the pipeline
  group and all-reduces it over DP x CP before scaling every stage's gradients once.

Example (CPU, a stage of a 2-stage pipeline)::

    link = StageLink(state.pg_collection.pp)
    reports, num_tokens = forward_backward_1f1b(forward_step_func=forward_step, data_iterator=it,
                                                model=ddp, num_microbatches=4, link=link)
    finalize_model_grads([ddp], num_tokens=num_tokens, pg_collection=state.pg_collection)
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from megatron_pack.parallel.pipeline import StageLink
from megatron_pack.training.chunks import core_model

__all__ = ["StageRun", "forward_backward_1f1b", "set_input_tensor", "stage_link", "stage_loss"]


def stage_link(cfg, state) -> Optional[StageLink]:
    """This rank's ``StageLink`` for ``cfg`` (a ``RingLink`` with virtual stages; None without pipeline
    stages): activations in the dtype the stages exchange (bfloat16 with ``train.bf16``), and without
    the shape exchange when every pack has one shape (``model.builder.fixed_pack_shapes``)."""
    if state.pp_size == 1:
        return None
    from megatron_pack.model.builder import fixed_pack_shapes
    from megatron_pack.parallel.pipeline import fixed_activation_shape

    p = cfg.parallel
    shape = (fixed_activation_shape(cfg.packing.packed_sequence_size, cp=p.context_parallel_size,
                                    tp=p.tensor_model_parallel_size, sequence_parallel=p.sequence_parallel,
                                    hidden_size=cfg.model.hidden_size) if fixed_pack_shapes(cfg) else None)
    dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
    if p.num_model_chunks > 1:  # virtual stages: the chunks pass activations round the ring
        from megatron_pack.parallel.pipeline import RingLink

        return RingLink(state.pp_group, num_chunks=p.num_model_chunks, dtype=dtype, fixed_shape=shape,
                        device=state.device)
    return StageLink(state.pp_group, dtype=dtype, fixed_shape=shape, device=state.device)


def set_input_tensor(model: torch.nn.Module, tensor: Optional[torch.Tensor]) -> None:
    """The activation this stage starts from (None on the first stage: the embedding's)."""
    core_model(model).set_input_tensor(tensor)


def stage_loss(loss_fn: Callable, output: torch.Tensor, *, per_token_loss: bool,
               num_microbatches: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The loss stage's ``(what backward runs on, target tokens as int32, report)`` for one micro-batch:
    the loss SUM with per-token loss; without it sum / target count / ``num_microbatches``, as
    megatron-core's schedules do."""
    loss_sum, num_tokens, report = loss_fn(output)
    if not per_token_loss:
        loss_sum = loss_sum / torch.clamp(num_tokens, min=1) / num_microbatches
    return loss_sum, num_tokens.detach().cpu().to(torch.int32), report


class StageRun:
    """One stage's (or model chunk's) forward and backward of a micro-batch, and what it adds up."""

    def __init__(self, forward_step_func: Callable, data_iterator: Iterator, model: torch.nn.Module,
                 num_microbatches: int, per_token_loss: bool):
        self.forward_step_func, self.data_iterator, self.model = forward_step_func, data_iterator, model
        self.num_microbatches, self.per_token_loss = num_microbatches, per_token_loss
        self.reports: list[dict] = []
        self.num_tokens = torch.zeros((), dtype=torch.int32)

    def forward(self, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        set_input_tensor(self.model, input_tensor)
        output, loss_fn = self.forward_step_func(self.data_iterator, self.model)
        if not core_model(self.model).post_process:  # the loss is on the chunk with the output layer
            return output
        loss, num_tokens, report = stage_loss(loss_fn, output, per_token_loss=self.per_token_loss,
                                              num_microbatches=self.num_microbatches)
        self.reports.append(report)
        self.num_tokens += num_tokens
        return loss

    @staticmethod
    def backward(input_tensor: Optional[torch.Tensor], output: torch.Tensor,
                 output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if output_grad is None:
            output.backward()
        else:
            torch.autograd.backward(output, grad_tensors=output_grad.to(output.dtype))
        return None if input_tensor is None else input_tensor.grad


def forward_backward_1f1b(*, forward_step_func: Callable, data_iterator: Iterator, model: torch.nn.Module,
                          num_microbatches: int, link: StageLink, per_token_loss: bool = True,
                          forward_only: bool = False) -> tuple[list[dict], torch.Tensor]:
    """Run this stage's part of the 1F1B schedule; returns (loss reports, target tokens), both
    from the last stage only (the other stages return ``[]`` and a zero count).

    ``forward_only`` runs the forwards alone (validation): every stage passes its activations on,
    the last stage reports the losses, nothing is backpropagated.
    """
    stage = StageRun(forward_step_func, data_iterator, model, num_microbatches, per_token_loss)
    if forward_only:
        with torch.no_grad():
            for _ in range(num_microbatches):
                link.send_forward(stage.forward(link.recv_forward()))
        return stage.reports, stage.num_tokens
    num_warmup = min(link.pp_size - link.pp_rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)()
    no_sync.__enter__()
    pending: list[tuple[Optional[torch.Tensor], torch.Tensor]] = []
    done = 0

    def backward(output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        nonlocal done
        input_tensor, output = pending.pop(0)
        done += 1
        if done == num_microbatches:  # the last backward syncs the gradients
            no_sync.__exit__(None, None, None)
        return stage.backward(input_tensor, output, output_grad)

    for _ in range(num_warmup):
        input_tensor = link.recv_forward()
        output = stage.forward(input_tensor)
        link.send_forward(output)
        pending.append((input_tensor, output))
    input_tensor = link.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        output = stage.forward(input_tensor)
        pending.append((input_tensor, output))
        input_grad = backward(link.send_forward_recv_backward(output, grad_of=pending[0][1]))
        if i == num_steady - 1:
            link.send_backward(input_grad)
        else:
            input_tensor = link.send_backward_recv_forward(input_grad)
    for _ in range(num_warmup):
        _, output = pending[0]
        link.send_backward(backward(link.recv_backward(output)))
    if done < num_microbatches:  # no micro-batch at all: leave no_sync all the same
        no_sync.__exit__(None, None, None)
    return stage.reports, stage.num_tokens
