"""Training: the step (PackedSeqParams, loss), the loop, optimizer, checkpoints and metrics.

Submodules import megatron-core; import them directly (``from megatron_pack.training.step import loss_func``).
"""
