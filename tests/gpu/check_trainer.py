"""The GPU checks that run the user's path: the real trainer, the distributed optimizer, verify, two ranks.

Each check (``checks.py`` runs it in its own process) makes its own tiny Hugging Face folder
(``megatron_pack.model.hf.synthetic.write_random_folder``: a 2-layer Llama, vocabulary 384, safetensors
only) and prepares the quickstart's synthetic set with the byte tokenizer into a temporary folder, so it
needs no network and no transformers (``verify_transformers`` alone does, and skips without it).

* ``trainer_world1``        ``build_trainer`` at world 1 on the device, 20 quickstart steps (float32), and the
                            same run on the CPU in a child process with CUDA hidden: equal losses (rel 1e-3)
* ``dist_optimizer_world1`` the same trainer with ``ddp.use_distributed_optimizer=true``, 5 steps: the plain
                            optimizer's losses (rel 1e-5)
* ``verify_transformers``   ``megatron-pack verify ... verify.reference=transformers`` on the device: PASS
* ``two_ranks_gloo``        ``torchrun --nproc-per-node 2 -m megatron_pack.train parallel.backend=gloo`` with both
                            ranks on the one GPU, at CP=2 and at PP=2: the world-1 losses (rel 1e-4); a probe of
                            gloo's collectives on device tensors first, and a layout whose run stops on an error
                            the probe saw gloo raise is skipped with that error

``MEGATRON_PACK_GPU_CHECK_DEVICE=cpu`` runs them on the CPU with 2 steps each: plumbing only.
Importing this module imports no torch (``tests/unit/test_gpu_run_script.py`` imports ``checks.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEVICE = os.environ.get("MEGATRON_PACK_GPU_CHECK_DEVICE", "cuda")
PLUMBING = DEVICE == "cpu"
"""A CPU run proves only that the checks run: fewer steps and samples."""

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 384, "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False, "hidden_act": "silu"}
"""The quickstart's tiny model as a Hugging Face folder (vocabulary 384 holds the byte tokenizer's ids)."""

QUICKSTART = ["experiment=quickstart", "model=pretrained", "model.seq_length=512", "data.tokenizer=byte",
              "packing.pad_seq_to_mult=4", "checkpoint.enabled=false", "logging.tensorboard=false",
              f"data.synthetic_num_samples={120 if PLUMBING else 600}"]
"""The quickstart (512-token packs, 8 per step) from a pretrained folder, with the pad multiple of CP=2 at
every layout, so that the world-1, CP=2 and PP=2 runs read the same packs."""
WORLD1 = ["parallel=cp1"]

SLOW = 10 if PLUMBING else 1
"""Inner timeouts stretch on a CPU plumbing run (a loaded laptop or CI core, not the GPU machine's 16)."""
TRAIN_STEPS = 2 if PLUMBING else 20
FEW_STEPS = 2 if PLUMBING else 5
TWO_RANK_STEPS = 2 if PLUMBING else 3


def _row(status: str, value: str = "", detail: str = "") -> dict:
    return {"status": status, "value": value, "detail": detail}


def _rel(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two equally long loss lists."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _make_run(work: Path) -> list[str]:
    """The tiny folder and the prepared quickstart set in ``work``; the overrides that train on them."""
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare
    from megatron_pack.model.hf.synthetic import write_random_folder

    write_random_folder(work / "tiny-llama", TINY_LLAMA)
    overrides = QUICKSTART + [f"model.pretrained={work / 'tiny-llama'}", f"data.dataset_dir={work / 'data'}"]
    prepare(load_config(overrides + WORLD1 + [f"train.output_dir={work / 'prepare'}"]), progress=False)
    return overrides


def train_losses(overrides: list[str], device: str, steps: int) -> dict:
    """``steps`` steps of the real trainer (``build_trainer``) at world 1 in this process on ``device``
    (``overrides`` name no parallel layout)."""
    import torch

    from megatron_pack.config import load_config
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.data.batches.opening import open_dataset
    from megatron_pack.training.loop import build_loader, build_trainer

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides: the CPU has no TF32
    torch.backends.cudnn.allow_tf32 = False
    cfg = load_config(overrides + WORLD1 + [f"train.device={device}", f"train.train_iters={steps}"])
    state = initialize_parallel(cfg)
    try:
        trainer = build_trainer(cfg, state, build_loader(cfg, state, open_dataset(cfg)))
        metrics = [trainer.train_step() for _ in range(steps)]
        return {"losses": [m.lm_loss for m in metrics], "step_s": [m.step_time_s for m in metrics],
                "real_tokens": [m.real_tokens for m in metrics], "device": str(state.device),
                "tflops": [m.model_tflops_per_device for m in metrics], "mfu": [m.mfu for m in metrics],
                "optimizer": type(trainer.optimizer).__name__,
                "cuda_graphs": bool(trainer.cuda_graphs is not None and trainer.cuda_graphs.captured)}
    finally:
        destroy_parallel(destroy_process_group=True)


def _cpu_losses(overrides: list[str], steps: int, timeout: int) -> dict:
    """:func:`train_losses` on the CPU in a child process that sees no GPU (the device is chosen per process)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MEGATRON_PACK_GPU_CHECK_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, __file__, "--train-run", json.dumps([overrides, "cpu", steps])],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("TRAIN "):
            return json.loads(line[len("TRAIN "):])
    raise RuntimeError(f"the CPU run exited {out.returncode}: {_error_line(out.stdout + out.stderr)}")


def _speed(run: dict) -> str:
    """Median step time after the first step, with the step's model TFLOP/s per device and MFU (where the peak is known)."""
    times = run["step_s"][1:] or run["step_s"]
    median = statistics.median(times)
    tokens = statistics.median(run["real_tokens"])
    line = f"median step {median * 1e3:.1f} ms ({tokens / median:,.0f} real tokens/s)"
    tflops = [t for t in (run["tflops"][1:] or run["tflops"]) if t is not None]
    if tflops:
        line += f", {statistics.median(tflops):.3g} model TFLOP/s/dev"
        mfu = [m for m in (run["mfu"][1:] or run["mfu"]) if m is not None]
        line += f" (MFU {100 * statistics.median(mfu):.2f}%)" if mfu else " (no peak known for this device)"
    return line


def _changes(losses: list[float]) -> bool:
    """The run really trained: its loss moved."""
    return len(set(losses)) > 1


# --------------------------------------------------------------------------- checks

def _missing(*modules: str):
    """Why one of ``modules`` cannot be used here (the first that does not import), or None."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken install raising anything else
            return f"{name} does not import ({type(exc).__name__}: {str(exc)[:120]})"
    return None


FOLDER_NEEDS = "needs safetensors (the tiny pretrained folder)"


def check_trainer_world1() -> dict:
    missing = _missing("safetensors")
    if missing:
        return _row("SKIP", detail=f"{FOLDER_NEEDS}: {missing}")
    with tempfile.TemporaryDirectory(prefix="gpu_trainer_") as tmp:
        overrides = _make_run(Path(tmp))
        dev = train_losses(overrides + [f"train.output_dir={tmp}/dev"], DEVICE, TRAIN_STEPS)
        cpu = _cpu_losses(overrides + [f"train.output_dir={tmp}/cpu"], TRAIN_STEPS, timeout=50 * SLOW)
    rel = _rel(dev["losses"], cpu["losses"])
    ok = rel < 1e-3 and _changes(cpu["losses"]) and dev["device"].startswith(DEVICE) and cpu["device"] == "cpu"
    return _row("PASS" if ok else "FAIL", f"{TRAIN_STEPS} steps, loss rel diff vs CPU {rel:.1e}; {_speed(dev)}",
                f"losses {dev['device']} {dev['losses'][0]:.6f} -> {dev['losses'][-1]:.6f}, cpu {cpu['losses'][0]:.6f}"
                f" -> {cpu['losses'][-1]:.6f}; optimizer {dev['optimizer']}; quickstart packs of 512 x 8 per step, "
                f"tiny Llama folder, float32; tol 1e-3")


def check_dist_optimizer_world1() -> dict:
    missing = _missing("safetensors")
    if missing:
        return _row("SKIP", detail=f"{FOLDER_NEEDS}: {missing}")
    with tempfile.TemporaryDirectory(prefix="gpu_distopt_") as tmp:
        overrides = _make_run(Path(tmp))
        plain = train_losses(overrides + [f"train.output_dir={tmp}/plain"], DEVICE, FEW_STEPS)
        sharded = train_losses(overrides + [f"train.output_dir={tmp}/dist", "ddp.use_distributed_optimizer=true"],
                               DEVICE, FEW_STEPS)
    rel = _rel(sharded["losses"], plain["losses"])
    ok = rel < 1e-5 and _changes(plain["losses"])
    return _row("PASS" if ok else "FAIL", f"{FEW_STEPS} steps, loss rel diff vs plain {rel:.1e}",
                f"ddp.use_distributed_optimizer=true ({sharded['optimizer']}) vs false ({plain['optimizer']}) on "
                f"{plain['device']}, losses {plain['losses'][0]:.6f} -> {plain['losses'][-1]:.6f}; tol 1e-5")


def check_verify_transformers() -> dict:
    missing = _missing("safetensors", "transformers")
    if missing:
        return _row("SKIP", detail=f"needs transformers (the reference) and safetensors: {missing}")
    with tempfile.TemporaryDirectory(prefix="gpu_verify_") as tmp:
        overrides = _make_run(Path(tmp))
        cmd = [sys.executable, "-m", "megatron_pack.cli.main", "verify", *overrides, *WORLD1, f"train.device={DEVICE}",
               "verify.reference=transformers", "verify.num_packs=4"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=45 * SLOW, cwd=tmp)
    text = out.stdout + out.stderr
    verdict = [line for line in text.splitlines() if line.startswith("verify: ") and line.endswith(("PASS", "FAIL"))]
    if not verdict:
        return _row("FAIL", detail=f"exit {out.returncode}: {_error_line(text)}")
    diffs = [float(part.split()[0]) for part in text.split("max |logit diff| ")[1:]]
    ok = out.returncode == 0 and verdict[-1].endswith("PASS") and "reference transformers" in verdict[-1]
    return _row("PASS" if ok else "FAIL", f"max |logit diff| {max(diffs, default=float('nan')):.1e}",
                f"{verdict[-1][:200]} (exit {out.returncode}; 4 quickstart packs, tiny Llama folder, device {DEVICE})")


# ----- two gloo ranks on one GPU

PROBE_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
             "send_recv", "batch_isend_irecv")


def _probe_op(name: str, dist, torch, device) -> None:
    """One collective on ``device`` tensors between the two ranks; raises what gloo raises, or on a wrong result."""
    rank = dist.get_rank()
    x = torch.full((4,), float(rank + 1), device=device)
    if name == "all_reduce":
        dist.all_reduce(x)
        want = torch.full((4,), 3.0)
    elif name == "broadcast":
        dist.broadcast(x, src=0)
        want = torch.full((4,), 1.0)
    elif name == "all_gather_into_tensor":
        out = torch.empty(8, device=device)
        dist.all_gather_into_tensor(out, x)
        x, want = out, torch.tensor([1.0] * 4 + [2.0] * 4)
    elif name == "all_gather":
        parts = [torch.empty(4, device=device) for _ in range(2)]
        dist.all_gather(parts, x)
        x, want = torch.cat(parts), torch.tensor([1.0] * 4 + [2.0] * 4)
    elif name == "reduce_scatter_tensor":
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, x)
        x, want = out, torch.full((2,), 3.0)
    elif name == "send_recv":
        if rank == 0:
            dist.send(x, dst=1)
        else:
            dist.recv(x, src=0)
        want = torch.full((4,), 1.0)
    else:
        peer = 1 - rank
        got = torch.empty(4, device=device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, got, peer)]):
            work.wait()
        x, want = got, torch.full((4,), float(peer + 1))
    if not torch.equal(x.cpu(), want):
        raise RuntimeError(f"wrong result {x.cpu().tolist()}, expected {want.tolist()}")


def gloo_probe() -> None:
    """Under torchrun (2 ranks, gloo): whether each collective takes ``DEVICE`` tensors; rank 0 prints
    ``PROBE <op> ok`` or ``PROBE <op> <error>`` as each one ends (a hung op prints nothing)."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    device = torch.device(DEVICE)
    for name in PROBE_OPS:
        try:
            _probe_op(name, dist, torch, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            result = "ok"
        except Exception as exc:
            result = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
        if dist.get_rank() == 0:
            print(f"PROBE {name} {result}", flush=True)
        dist.barrier()  # a CPU-side barrier: the next op starts together whatever this one did
    dist.destroy_process_group()


def _torchrun(args: list[str], cwd: str, timeout: int) -> tuple[int | None, str]:
    """``torchrun --nproc-per-node 2 ARGS``: its exit status (None when it ran past ``timeout``: then every
    process it started is killed, so none is left holding the GPU) and its output."""
    # two ranks on one GPU on purpose: the one run allowed to have more ranks than GPUs (parallel.groups.SHARE_GPUS_ENV)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PACK_SHARE_GPUS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        text = proc.communicate(timeout=timeout)[0]
        return proc.returncode, text
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]


def _error_line(text: str) -> str:
    """The line of a failed run's output that names its error (torchrun's own summary comes last, so it is not
    the last line), else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"\w+(Error|Exception)\b|^megatron-pack \w+:|^- ", line)
             and "ChildFailedError" not in line and not line.startswith(("File ", "raise ", "return "))]
    return (named or lines or ["(no output)"])[-1][:240]


def _probe(tmp: str) -> dict:
    """``{op: "ok" | error}`` for each of ``PROBE_OPS`` on two gloo ranks sharing the device."""
    timeout = 30 * SLOW
    code, text = _torchrun([__file__, "--gloo-probe"], tmp, timeout=timeout)
    result = dict(line[len("PROBE "):].split(" ", 1) for line in text.splitlines() if line.startswith("PROBE "))
    if code is None and len(result) < len(PROBE_OPS):
        result[PROBE_OPS[len(result)]] = f"hung: no answer in {timeout} s"
    for op in PROBE_OPS[len(result):]:  # the probe died (or hung) before these
        result[op] = f"not probed: the probe exited {code}: {_error_line(text)}"
    return result


def _two_rank_layout(name: str, layout: str, overrides: list[str], tmp: str, reference: list[float],
                     refused: dict) -> tuple[str, str]:
    """``(status, detail)`` of ``megatron-pack train`` on 2 gloo ranks at ``layout`` against the world-1 losses."""
    from megatron_pack.training.metrics import read_metrics

    out_dir = f"{tmp}/{layout.replace('=', '_')}"
    timeout = 32 * SLOW
    code, text = _torchrun(["-m", "megatron_pack.train", *overrides, layout, "parallel.backend=gloo",
                            f"train.device={DEVICE}", f"train.train_iters={TWO_RANK_STEPS}",
                            f"train.output_dir={out_dir}"], tmp, timeout=timeout)
    if code != 0:
        seen = [f"{op} ({err})" for op, err in refused.items()
                if not err.startswith(("not probed", "hung")) and err.split(": ", 1)[-1][:60] in text]
        if seen:
            return "SKIP", f"{name}: gloo refuses device tensors: {'; '.join(seen)}"
        if code is None:
            return "FAIL", f"{name}: timed out after {timeout} s: {_error_line(text)}"
        return "FAIL", f"{name}: exit {code}: {_error_line(text)}"
    losses = [r["lm_loss"] for r in read_metrics(Path(out_dir) / "metrics.jsonl")]
    rel = _rel(losses, reference)
    return ("PASS" if rel < 1e-4 else "FAIL"), f"{name}: loss rel diff vs world 1 {rel:.1e}"


def check_two_ranks_gloo() -> dict:
    missing = _missing("safetensors")
    if missing:
        return _row("SKIP", detail=f"{FOLDER_NEEDS}: {missing}")
    with tempfile.TemporaryDirectory(prefix="gpu_gloo_") as tmp:
        probe = _probe(tmp)
        refused = {op: err for op, err in probe.items() if err != "ok"}
        overrides = _make_run(Path(tmp))
        world1 = train_losses(overrides + [f"train.output_dir={tmp}/world1"], DEVICE, TWO_RANK_STEPS)["losses"]
        parts = [_two_rank_layout(name, layout, overrides, tmp, world1, refused)
                 for name, layout in (("CP=2", "parallel=cp2"), ("PP=2", "parallel=pp2"))]
    statuses = {status for status, _ in parts}  # what gloo allows passed: PASS, and a skipped layout says why
    status = "FAIL" if "FAIL" in statuses else ("PASS" if "PASS" in statuses else "SKIP")
    return _row(status, "; ".join(d.split(": ", 1)[0] + " " + s for s, d in parts), "; ".join(d for _, d in parts)
                + f"; {TWO_RANK_STEPS} steps, both ranks on {DEVICE}; gloo probe: {_probe_summary(refused)}")


def _probe_summary(refused: dict) -> str:
    """``refused`` (op -> error) in one line, each distinct error once."""
    if not refused:
        return "all collectives take device tensors"
    by_error: dict[str, list[str]] = {}
    for op, err in refused.items():
        by_error.setdefault(err, []).append(op)
    return "failed: " + "; ".join(f"{', '.join(ops)} ({err})" for err, ops in by_error.items())


def main(argv: list[str]) -> int:
    if argv[:1] == ["--train-run"]:
        overrides, device, steps = json.loads(argv[1])
        print("TRAIN " + json.dumps(train_losses(overrides, device, steps)), flush=True)
        return 0
    if argv[:1] == ["--gloo-probe"]:
        gloo_probe()
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.path[:0] = [p for p in (str(ROOT),) if p not in sys.path]
    sys.exit(main(sys.argv[1:]))
