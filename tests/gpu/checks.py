"""Every GPU check of the project, one subprocess and one timeout each, one table (``tests/gpu/run.sh``).

Checks (name, what passes):

* ``torch_thd_core``    our torch THD attention on CUDA (float32, TF32 off) equals the CPU result
                        (outputs and input gradients, real rows; CP 1 and the CP 2 query split)
* ``te_thd_attention``  Transformer Engine's fused THD attention (bf16) against our torch core
                        (``check_te_thd.py``), when TE imports
* ``te_thd_cp2``        the TE layer spec's attention at CP=2 (two ranks, NCCL: needs two GPUs) equals CP=1 on a
                        tail-padded pack, no real row exactly 0 (TE issue #3331; ``check_graphs_te.py``)
* ``cuda_graph_loop``   the product's loop (``build_trainer``/``train_step``) with ``model.cuda_graph_impl=local``
                        and ``transformer_engine`` (scope [mlp], bf16) captures and gives the eager losses
                        (``check_graphs_te.py``), when TE imports
* ``bf16_loss_parity``  the tiny GPTModel's pack loss in float32 on CUDA equals the float64
                        CPU reference (``tests/_float64_gpt.py``), and in bf16 (megatron-core's
                        ``Float16Module``, what ``train.bf16`` runs) is within 1 %
* ``fp8_shapes``        per ``model.fp8`` recipe this GPU runs: a TE FP8 linear accepts every CP
                        rank's rows of packs collated at the pack multiple (CP 1, 2, 4, 8), and a
                        GPTModel built with ``model.fp8`` keeps padded rows at 0 at every FP8 GEMM
                        input and its amax history does not depend on the pack's tail length
* ``trainer_world1``    ``build_trainer`` at world 1 on CUDA trains 20 quickstart steps from a tiny
                        pretrained folder: the CPU run's losses (float32, rel 1e-3); prints the step time
* ``dist_optimizer_world1`` the same with ``ddp.use_distributed_optimizer=true`` (megatron-core's
                        distributed optimizer), 5 steps: the plain optimizer's losses (rel 1e-5)
* ``verify_transformers`` ``megatron-pack verify ... verify.reference=transformers`` on CUDA: PASS
* ``two_ranks_gloo``    ``torchrun --nproc-per-node 2 -m megatron_pack.train parallel.backend=gloo``, both
                        ranks on the one GPU, at CP=2 and at PP=2: the world-1 losses (rel 1e-4), where a
                        probe of gloo's collectives on CUDA tensors allows it; else the row names what gloo refused

The last four are in ``check_trainer.py``; they make their folder and data in a temporary directory.

On a machine without CUDA every check is skipped with the reason and the exit status is 0; on a
GPU the status is 1 when a check fails (a skip is not a failure). ``--one NAME`` runs one check
in this process and prints ``RESULT {json}``; with ``MEGATRON_PACK_GPU_CHECK_DEVICE=cpu`` it runs the check
on the CPU (plumbing only: it proves the check runs, not the GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for path in (str(ROOT), str(ROOT / "tests"), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

from check_graphs_te import _row, _te_missing, check_cuda_graph_loop, check_te_thd_cp2  # noqa: E402,F401  (torch-free import)
from check_trainer import (check_dist_optimizer_world1, check_trainer_world1,  # noqa: E402,F401  (torch-free import)
                           check_two_ranks_gloo, check_verify_transformers)

DEVICE = os.environ.get("MEGATRON_PACK_GPU_CHECK_DEVICE", "cuda")
"""Where the checks run; 'cpu' only exercises their plumbing (``--one NAME`` on a CPU host), it proves nothing."""

CHECKS = [("torch_thd_core", 35), ("te_thd_attention", 40), ("te_thd_cp2", 35), ("cuda_graph_loop", 75),
          ("bf16_loss_parity", 35), ("fp8_shapes", 60), ("trainer_world1", 75), ("dist_optimizer_world1", 45),
          ("verify_transformers", 45), ("two_ranks_gloo", 95)]
"""(check, timeout in seconds): 540 s at most together, inside run.sh's 10 minutes with the install (about 41 MiB
of wheels) and the preflight. The TE checks skip at once without Transformer Engine, te_thd_cp2 with one GPU."""




def _samples(rng, num: int, longest: int, vocab: int = 384) -> list[dict]:
    lengths = rng.integers(3, longest, size=num)
    return [{"input_ids": rng.integers(3, vocab, size=n).tolist() + [2], "loss_mask": [0, 0] + [1] * (n - 1),
             "sample_id": i} for i, n in enumerate(lengths)]


def _absmax(x) -> float:
    """max |x| as a float, 0.0 for an empty tensor."""
    return float(x.abs().max()) if x.numel() else 0.0


def _world_of_one(cfg):
    from megatron_pack.parallel.groups import initialize_parallel

    return initialize_parallel(cfg)


def _to_device(batch: dict, device) -> tuple:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron_pack.training.step import get_packed_seq_params

    params = get_packed_seq_params(batch, force_padded=True)
    params = PackedSeqParams(**{k: (v.to(device) if hasattr(v, "to") else v) for k, v in vars(params).items()})
    return tuple(batch[k].to(device) for k in ("tokens", "labels", "position_ids", "loss_mask")) + (params,)


def _pack_loss(model, batch, device):
    from megatron_pack.training.step import loss_func

    tokens, labels, positions, mask, params = _to_device(batch, device)
    losses = model(tokens, positions, None, labels=labels, packed_seq_params=params)
    return loss_func(mask, losses)[0]


# --------------------------------------------------------------------------- checks

def check_torch_thd_core() -> dict:
    import torch

    from check_te_thd import make_pack, real_rows
    from megatron_pack.model.attention import thd_attention
    from megatron_pack.parallel.cp import thd_partition_indices

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cu, cu_pad = make_pack(2048, 6, 8)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2048, h, 64, generator=g) for h in (8, 2, 2)]
    rows = real_rows(cu, cu_pad)
    worst_out = worst_grad = 0.0
    for cp, rank in ((1, 0), (2, 0), (2, 1)):
        index = thd_partition_indices(torch.tensor(cu_pad), cp, rank) if cp > 1 else None
        results = []
        for device in ("cpu", DEVICE):
            q, k, v = (x.to(device).requires_grad_(True) for x in inputs)
            query = q if index is None else q[index.to(device)]
            out = thd_attention(query, k, v, cu, cu_pad, query_index=None if index is None else index.to(device))
            keep = torch.isin(index if index is not None else torch.arange(2048), rows).to(device)
            grads = torch.autograd.grad(out[keep].square().sum(), (q, k, v))
            results.append((out.detach().cpu(), [x.cpu() for x in grads], keep.cpu()))
        (o_cpu, g_cpu, keep), (o_gpu, g_gpu, _) = results
        if _absmax(o_gpu[~keep]) != 0.0:
            return _row("FAIL", detail=f"padded rows not zero on CUDA at cp={cp} rank={rank}")
        worst_out = max(worst_out, float((o_cpu - o_gpu).abs().max()))
        worst_grad = max(worst_grad, max(float((a - b).abs().max()) for a, b in zip(g_cpu, g_gpu)))
    ok = worst_out < 1e-4 and worst_grad < 1e-3
    return _row("PASS" if ok else "FAIL", f"max|out diff| {worst_out:.2e}, max|grad diff| {worst_grad:.2e}",
                "float32, pack 2048 x 6 seqs, 8/2 heads x 64; CP 1 and both CP 2 ranks (query_index); tol 1e-4 / 1e-3")


def check_te_thd_attention() -> dict:
    missing = _te_missing()
    if missing:
        return _row("SKIP", detail=f"needs Transformer Engine: {missing}")
    import torch

    import check_te_thd

    args = argparse.Namespace(pack_size=4096, num_seqs=8, pad_multiple=8, heads=16, kv_heads=4, dim=64, iters=3)
    row = check_te_thd.check_dtype(args, torch.bfloat16)
    if "te_error" in row:
        return _row("FAIL", detail=row["te_error"][:300])
    ok = row["max_abs_diff_out"] < 5e-2
    return _row("PASS" if ok else "FAIL", f"bf16 max|out diff| {row['max_abs_diff_out']:.2e}, "
                f"max|grad diff| {row['max_abs_diff_grad']:.2e}, TE/ours fwd+bwd {row['speedup_te_over_ours_fwd_bwd']}x",
                "pack 4096 x 8 seqs, 16/4 heads x 64, padding_causal with cu_seqlens_padded; tol 5e-2 on outputs")


def _te_model_cfg(extra: list[str]):
    from megatron_pack.config import load_config

    return load_config(["model.attention_backend=te", "model.params_dtype=bfloat16", "train.bf16=true", "model.hidden_size=128",
                        "model.ffn_hidden_size=256", "model.num_attention_heads=4", "model.num_query_groups=2",
                        "packing.packed_sequence_size=256", "model.seq_length=256"] + extra)


def check_bf16_loss_parity() -> dict:
    import numpy as np
    import torch
    from megatron.core.transformer.module import Float16Module

    import _float64_gpt as ref
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # float32 params (a wide init, so the loss is far from ln(vocab) and feels the precision), bf16 wrapper below
    cfg = load_config(["model.attention_backend=torch", "train.bf16=true", "model.init_method_std=0.3"])
    state = _world_of_one(cfg)
    model = build_model(cfg, state).eval()
    rng = np.random.default_rng(1)
    samples = _samples(rng, 5, 80)
    batch = collate_thd(samples, pack_size=512, pad_multiple=8)
    dev = torch.device(DEVICE)
    with torch.no_grad():
        fp32 = float(_pack_loss(model, batch, dev))
        p64 = ref.to_float64({n: p.detach().cpu() for n, p in model.named_parameters()})
        f64 = float(sum(ref.sample_loss(p64, s["input_ids"], s["loss_mask"])[0] for s in samples))
        twin = build_model(cfg, state)  # the same weights, then megatron-core's bf16 wrapper (what train.bf16 runs)
        twin.load_state_dict(model.state_dict())
        half = Float16Module(twin.config, twin).eval()
        bf16 = float(_pack_loss(half, batch, dev))
    rel32, rel16 = abs(fp32 - f64) / abs(f64), abs(bf16 - fp32) / abs(fp32)
    ok = rel32 < 1e-4 and rel16 < 1e-2
    return _row("PASS" if ok else "FAIL", f"fp32 vs float64 ref {rel32:.1e}, bf16 vs fp32 {rel16:.1e}",
                f"loss sums {f64:.4f} (float64 CPU) / {fp32:.4f} / {bf16:.4f}; tiny model (init std 0.3), torch layers; tol 1e-4 / 1e-2")


_RECIPES = ("delayed", "current", "mxfp8", "blockwise")


def _te_recipe(name: str):
    from transformer_engine.common import recipe as R

    return {"delayed": lambda: R.DelayedScaling(fp8_format=R.Format.HYBRID),
            "current": lambda: R.Float8CurrentScaling(fp8_format=R.Format.HYBRID),
            "mxfp8": lambda: R.MXFP8BlockScaling(), "blockwise": lambda: R.Float8BlockScaling()}[name]()


def _linear_rows_ok(recipe: str) -> tuple[bool, str]:
    """A TE FP8 Linear runs forward+backward on every CP rank's rows of packs collated at the rule."""
    import numpy as np
    import torch
    import transformer_engine.pytorch as te

    from megatron_pack.config.layout import pack_multiple, pad_multiple
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.cp import slice_thd_batch

    layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
    rng = np.random.default_rng(2)
    sizes = set()
    for cp in (1, 2, 4, 8):
        whole = pack_multiple(cp, 1, False, recipe)
        batch = collate_thd(_samples(rng, 3, 40), pack_size=whole * max(1, 1024 // whole),
                            pad_multiple=pad_multiple(cp, 1, False), pack_multiple=whole)
        for rank in range(cp):
            rows = slice_thd_batch(batch, cp, rank)["tokens"].shape[1]
            sizes.add(rows)
            x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with te.fp8_autocast(enabled=True, fp8_recipe=_te_recipe(recipe)):
                y = layer(x)
            y.float().square().sum().backward()
    return True, f"rows per rank {sorted(sizes)}"


def _amax_state(model) -> list:
    import torch

    out = []
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if isinstance(meta, dict):
            for key in ("scaling_fwd", "scaling_bwd"):
                if key in meta and hasattr(meta[key], "amax_history"):
                    out.append(meta[key].amax_history.detach().float().clone())
    return out or [torch.zeros(0)]


def _model_padding(recipe: str) -> tuple[bool, str]:
    """GPTModel with model.fp8: padded rows 0 at every TE linear input; delayed: amax history independent of the tail."""
    import numpy as np
    import torch

    from megatron_pack.config.layout import pack_multiple
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel

    cfg = _te_model_cfg([f"model.fp8={recipe}"])
    state = _world_of_one(cfg)
    try:
        samples = _samples(np.random.default_rng(3), 3, 30)  # at most 90 tokens: the short pack stays <= 128
        short = collate_thd(samples, pack_size=256, pad_multiple=1, pack_multiple=pack_multiple(1, 1, False, recipe))
        long_ = collate_thd(samples, pack_size=256, pad_multiple=1, pad_to_max_length=True)
        runs, padded_max = [], 0.0
        for batch in (short, long_):
            torch.manual_seed(0)
            model = build_model(cfg, state).train()
            padded = ~torch.zeros(batch["tokens"].shape[1], dtype=torch.bool).index_fill_(
                0, torch.cat([torch.arange(int(a), int(a) + int(b) - int(c)) for a, b, c in zip(
                    batch["cu_seqlens_padded"][:-1], batch["cu_seqlens"][1:], batch["cu_seqlens"][:-1])]), True)
            seen = []

            def watch(module, args):
                x = args[0]
                seen.append(_absmax(x.reshape(padded.numel(), -1)[padded.to(x.device)]))
            hooks = [m.register_forward_pre_hook(watch) for n, m in model.named_modules()
                     if n.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))]
            loss = _pack_loss(model, batch, torch.device("cuda"))
            loss.backward()
            for h in hooks:
                h.remove()
            padded_max = max([padded_max] + seen)
            runs.append((float(loss), _amax_state(model), len(seen)))
        (loss_a, amax_a, n_a), (loss_b, amax_b, _) = runs
        detail = f"T {short['tokens'].shape[1]} vs {long_['tokens'].shape[1]}, {n_a} GEMM inputs watched, padded max|x| {padded_max}"
        ok = padded_max == 0.0 and n_a >= 8 and abs(loss_a - loss_b) <= 1e-2 * abs(loss_a)
        if recipe == "delayed":
            worst = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(amax_a, amax_b))
            ok = ok and len(amax_a) == len(amax_b) and worst < 1e-2
            detail += f", amax history rel diff {worst:.1e} ({len(amax_a)} tensors)"
        return ok, detail
    finally:
        destroy_parallel(destroy_process_group=True)


def check_fp8_shapes() -> dict:
    missing = _te_missing()
    if missing:
        return _row("SKIP", detail=f"needs Transformer Engine: {missing}")
    from megatron_pack.model.fp8 import te_recipe_problem

    parts, ok_all, ran = [], True, 0
    for recipe in _RECIPES:
        problem = te_recipe_problem(recipe)
        if problem:
            parts.append(f"{recipe}: skipped ({problem[:80]})")
            continue
        ran += 1
        try:
            ok1, d1 = _linear_rows_ok(recipe)
            ok2, d2 = _model_padding(recipe)
        except Exception as exc:
            ok_all = False
            parts.append(f"{recipe}: ERROR {type(exc).__name__}: {str(exc)[:160]}")
            continue
        ok_all = ok_all and ok1 and ok2
        parts.append(f"{recipe}: {'ok' if ok1 and ok2 else 'FAILED'} ({d1}; {d2})")
    status = "PASS" if ok_all and ran else ("SKIP" if not ran else "FAIL")
    return _row(status, f"{ran} of {len(_RECIPES)} recipes run", "; ".join(parts))


# --------------------------------------------------------------------------- driver

def run_one(name: str) -> dict:
    started = time.perf_counter()
    try:
        row = globals()[f"check_{name}"]()
    except Exception as exc:
        row = _row("FAIL", detail=f"{type(exc).__name__}: {str(exc)[:300]} | "
                                  + traceback.format_exc().strip().splitlines()[-3][:200])
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def run_isolated(name: str, timeout: int) -> dict:
    started = time.perf_counter()
    try:
        # cuBLAS needs a fixed workspace for deterministic algorithms (train.deterministic), whoever turns them on
        env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")}
        out = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=timeout,
                             cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return _row("FAIL", detail=f"timed out after {timeout} s") | {"seconds": timeout}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return _row("FAIL", detail=f"exit {out.returncode}: {tail[:300]}") | {"seconds": round(time.perf_counter() - started, 1)}


def table(rows: list[tuple[str, dict]], header: str) -> str:
    lines = [header, "", "| check | status | result | seconds | detail |", "|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['status']} | {r['value']} | {r.get('seconds', '')} | {r['detail']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=[n for n, _ in CHECKS])
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one)), flush=True)
        return 0
    import torch

    today = datetime.date.today().isoformat()
    if not torch.cuda.is_available():
        why = f"no CUDA device (torch {torch.__version__} sees none)"
        rows = [(name, _row("SKIP", detail=f"needs one GPU: {why}")) for name, _ in CHECKS]
        for name, _ in CHECKS:
            print(f"SKIP {name}: needs one GPU; {why}")
        print(table(rows, f"GPU checks, {today}: no GPU on this machine, every check skipped"))
        return 0
    header = (f"GPU checks, {today}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}, Transformer Engine: {_te_version()}")
    print(header, flush=True)
    rows = []
    for name, timeout in CHECKS:
        row = run_isolated(name, timeout)
        rows.append((name, row))
        print(f"{row['status']} {name}: {row['value']} {row['detail']}".rstrip(), flush=True)
    text = table(rows, header)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_checks.md").write_text(text + "\n")
    return 1 if any(r["status"] == "FAIL" for _, r in rows) else 0


def _te_version() -> str:
    missing = _te_missing()
    if missing:
        return f"absent ({missing})"
    import transformer_engine

    return getattr(transformer_engine, "__version__", "present")


if __name__ == "__main__":
    sys.exit(main())
