"""GPU checks of Transformer Engine's THD attention at CP=2 and of CUDA graphs through the product's own loop.

* ``te_thd_cp2``       two ranks (torchrun, NCCL): the TE layer spec's attention (megatron-core's
                       ``TEDotProductAttention`` told ``pad_between_seqs``: ``model/te_attention.py``) at CP=2 p2p on
                       a tail-padded pack equals the same class at CP=1 (outputs and input gradients on real rows,
                       bf16), and no real row comes out exactly 0 (the symptom of TE issue #3331). megatron-core's
                       class alone is run too, and its difference reported (not judged). NCCL refuses two ranks on
                       one GPU, so this needs two GPUs and is skipped, saying so, on one.
* ``cuda_graph_loop``  ``build_trainer`` + ``train_step`` (the product's loop) with TE layers and fixed-shape packs:
                       ``model.cuda_graph_impl=local`` (whole layers, float32) and ``transformer_engine``
                       (``cuda_graph_scope=[mlp]``, bf16) capture (``trainer.cuda_graphs.captured``) and give the
                       eager run's losses over 5 steps (local: recorded in step 1, replayed from step 2; TE: captured
                       after 3 eager steps, replayed in steps 4 and 5).

Importing this module imports no torch (``checks.py`` imports it before anything is installed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GRAPH_STEPS = 5


def _row(status: str, value: str = "", detail: str = "") -> dict:
    return {"status": status, "value": value, "detail": detail}


def _te_missing():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything else
        return f"transformer_engine does not import ({type(exc).__name__}: {str(exc)[:120]})"
    return None


# --------------------------------------------------------------------------- te_thd_cp2

def _attention(cls, cp: int, pg_collection):
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8 * 64, num_attention_heads=8, num_query_groups=2,
                               context_parallel_size=cp, bf16=True, params_dtype=torch.bfloat16)
    return cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
               cp_comm_type="p2p", pg_collection=pg_collection).cuda()


def _run(module, q, k, v, keep, params):
    """Output [rows, H*D] and the input gradients of sum(out[keep]^2)."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = module(q, k, v, None, AttnMaskType.causal, packed_seq_params=params)
    grads = torch.autograd.grad(out[keep].float().square().sum(), (q, k, v))
    return out.detach().float(), [g.float() for g in grads]


def te_cp2_worker() -> None:
    """Under torchrun (2 ranks): CP=2 against CP=1 on one tail-padded pack; rank 0 prints ``RESULT {json}``."""
    from types import SimpleNamespace

    import torch

    from check_te_thd import make_pack, real_rows
    from megatron_pack.config import load_config
    from megatron_pack.model.te_attention import padded_thd_attention_class
    from megatron_pack.parallel.comm import all_gather_object
    from megatron_pack.parallel.cp import thd_partition_indices
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = load_config(["parallel=cp2", "model.attention_backend=te", "train.device=cuda", "parallel.backend=nccl"])
    state = initialize_parallel(cfg)
    try:
        cu, cu_pad = make_pack(2048, 6, 4)  # every sub-sequence tail-padded to 2*CP
        batch = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32), "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32),
                 "max_seqlen": max(b - a for a, b in zip(cu_pad, cu_pad[1:]))}
        params = get_packed_seq_params(batch, device=state.device)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2048, h, 64, generator=g, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
        rows = real_rows(cu, cu_pad).cuda()
        index = thd_partition_indices(torch.tensor(cu_pad), 2, state.cp_rank).cuda()
        keep_local = torch.isin(index, rows)
        padded = padded_thd_attention_class()
        ref_out, ref_grads = _run(_attention(padded, 1, SimpleNamespace(tp=state.tp_group, cp=None)), q, k, v,
                                  torch.isin(torch.arange(2048, device="cuda"), rows), params)
        result = {}
        for name, cls in (("ours", padded), ("mcore_alone", padded.__mro__[1])):
            module = _attention(cls, 2, state.pg_collection)
            out, grads = _run(module, q[index], k[index], v[index], keep_local, params)
            scale = ref_out[index][keep_local].abs().max()
            result[name] = {
                "out": float((out[keep_local] - ref_out[index][keep_local]).abs().max() / scale),
                "grad": max(float((a - b[index]).abs().max() / b[index].abs().max()) for a, b in zip(grads, ref_grads)),
                "zero_real_rows": int((out[keep_local].abs().amax(dim=-1) == 0).sum()),
                "real_rows": int(keep_local.sum())}
        gathered = all_gather_object(result, group=state.cp_group)
        if state.rank == 0:
            print("RESULT " + json.dumps(gathered), flush=True)
    finally:
        destroy_parallel(destroy_process_group=True)


def check_te_thd_cp2() -> dict:
    missing = _te_missing()
    if missing:
        return _row("SKIP", detail=f"needs Transformer Engine: {missing}")
    import torch

    if torch.cuda.device_count() < 2:
        return _row("SKIP", detail=f"needs two GPUs ({torch.cuda.device_count()} visible): TE's CP=2 runs on NCCL, "
                                   "which refuses two ranks on one GPU; the CPU test tests/unit/test_te_attention.py "
                                   "holds what reaches TE")
    from check_trainer import _error_line, _torchrun

    with tempfile.TemporaryDirectory(prefix="gpu_te_cp2_") as tmp:
        code, text = _torchrun([__file__, "--te-cp2"], tmp, timeout=30)
    line = next((l for l in reversed(text.splitlines()) if l.startswith("RESULT ")), None)
    if code != 0 or line is None:
        return _row("FAIL", detail=f"exit {code}: {_error_line(text)}")
    ranks = json.loads(line[len("RESULT "):])
    ours = {key: max(r["ours"][key] for r in ranks) for key in ("out", "grad", "zero_real_rows")}
    alone = {key: max(r["mcore_alone"][key] for r in ranks) for key in ("out", "grad", "zero_real_rows")}
    ok = ours["out"] < 2e-2 and ours["grad"] < 5e-2 and ours["zero_real_rows"] == 0
    return _row("PASS" if ok else "FAIL", f"CP=2 vs CP=1 rel out {ours['out']:.1e}, grad {ours['grad']:.1e}, "
                f"zero real rows {ours['zero_real_rows']}",
                f"megatron-core's class alone (no pad_between_seqs): rel out {alone['out']:.1e}, grad "
                f"{alone['grad']:.1e}, zero real rows {alone['zero_real_rows']} (reported, not judged); pack 2048 x 6 "
                f"tail-padded to 4, 8/2 heads x 64, bf16, p2p; tol 2e-2 / 5e-2")


# --------------------------------------------------------------------------- cuda_graph_loop

FIXED_SHAPES = ["model.attention_backend=te", "data.pad_to_max_length=true", "packing.pad_cu_seqlens=true"]
VARIANTS = {  # name -> (extra overrides, the eager run it is held against)
    "eager_fp32": ([], None),
    "local_fp32": (["model.cuda_graph_impl=local"], "eager_fp32"),
    "eager_bf16": (["train.bf16=true"], None),
    "te_mlp_bf16": (["train.bf16=true", "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[mlp]"],
                    "eager_bf16"),
}
"""Each graph run follows its eager run in one process (megatron-core's graph records are per process)."""


def _train_runs(runs: list, timeout: int) -> dict:
    """``check_trainer.train_losses`` for each (name, overrides) in one child process on the device, in order."""
    out = subprocess.run([sys.executable, __file__, "--train-runs", json.dumps(runs)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    got = {}
    for line in out.stdout.splitlines():
        if line.startswith("TRAIN "):
            name, result = json.loads(line[len("TRAIN "):])
            got[name] = result
    if len(got) != len(runs):
        from check_trainer import _error_line

        raise RuntimeError(f"the runs {[n for n, _ in runs if n not in got]} exited {out.returncode}: "
                           f"{_error_line(out.stdout + out.stderr)}")
    return got


def check_cuda_graph_loop() -> dict:
    missing = _te_missing()
    if missing:
        return _row("SKIP", detail=f"needs Transformer Engine (CUDA graphs run the TE layers only): {missing}")
    from check_trainer import _make_run, _rel

    with tempfile.TemporaryDirectory(prefix="gpu_graphs_") as tmp:
        base = _make_run(Path(tmp)) + FIXED_SHAPES
        runs = {}
        for pair in (("eager_fp32", "local_fp32"), ("eager_bf16", "te_mlp_bf16")):
            runs.update(_train_runs([(n, base + VARIANTS[n][0] + [f"train.output_dir={tmp}/{n}"]) for n in pair],
                                    timeout=32))
    parts, ok = [], True
    for name, (_, eager) in VARIANTS.items():
        if eager is None:
            continue
        rel = _rel(runs[name]["losses"], runs[eager]["losses"])
        tol = 1e-3 if name.endswith("fp32") else 1e-2
        good = runs[name]["cuda_graphs"] and rel < tol and len(set(runs[eager]["losses"])) > 1
        ok = ok and good
        parts.append(f"{name}: captured {runs[name]['cuda_graphs']}, loss rel vs {eager} {rel:.1e} (tol {tol:g})")
    return _row("PASS" if ok else "FAIL", "; ".join(p.split(",")[0] for p in parts),
                "; ".join(parts) + f"; {GRAPH_STEPS} steps of build_trainer/train_step, quickstart packs of 512 "
                "(pad_to_max_length, pad_cu_seqlens), tiny Llama folder, TE layers")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--te-cp2"]:
        te_cp2_worker()
        return 0
    if argv[:1] == ["--train-runs"]:
        from check_trainer import train_losses

        for name, overrides in json.loads(argv[1]):
            print("TRAIN " + json.dumps([name, train_losses(overrides, "cuda", GRAPH_STEPS)]), flush=True)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "tests"), str(HERE)) if p not in sys.path]
    sys.exit(main(sys.argv[1:]))
