"""`megatron-pack train key=value ...` (also `python -m megatron_pack.train`), launched by torchrun.

Order: load and validate the whole config with the world size, the prepared dataset's
metadata, which fills in what prepare recorded (``megatron_pack.cli.run_config``), and the
checkpoint to resume from (nothing is built before that; a refusal prints once and exits 2),
initialise the process groups once, print one line saying what runs (rank 0; the resolved config
goes to ``<train.output_dir>/config.yaml`` and ``run.json``), then train (``megatron_pack.training.loop``).
Every warning is printed once, by rank 0 (``megatron_pack.cli.main.warn_once_on_rank_0``).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from megatron_pack.config.schema import ConfigError
from megatron_pack.data.formats.sources import DataError


def _setup_logging(level: str, rank: int) -> None:
    # rank 0 speaks for the run: the other ranks log errors only (their warnings are rank 0's, repeated)
    logging.basicConfig(level=getattr(logging, level) if rank == 0 else logging.ERROR,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its per-module INFO setup lines
    for handler in logging.getLogger().handlers:  # megatron-core warns some things once per layer
        handler.addFilter(OnceFilter())
    # "Implicit initialization of Rerun State Machine" / "initialized in mode DISABLED": megatron-core's
    # defaults, which this trainer runs with, said as warnings on every run
    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.ERROR)
    # the sample-id audit (logging.log_sample_ids) must cover every DP rank, not only rank 0
    logging.getLogger("megatron_pack.train.samples").setLevel(logging.INFO)
    # online packing's per-epoch accounting: one line per DP rank's shard (read = packed + dropped)
    logging.getLogger("megatron_pack.train.accounting").setLevel(logging.INFO)


class OnceFilter(logging.Filter):
    """Each distinct megatron-core warning once a run: it logs some once per layer (``Unknown MLP type: <class
    'ModuleSpec'>. Using default kwargs.`` for every MoE layer), which said the same line twice in a 2-layer run."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("megatron.") or record.levelno < logging.WARNING:
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


CHECK_FLAG = "--check"
"""``train --check key=value ...``: validate as a run of ``WORLD_SIZE`` ranks would, then exit
(0 and "config ok", or 2 and the problems). The launch scripts run it once before torchrun."""


CHECK_HOST_ENV = "MEGATRON_PACK_CHECK_HOST"
"""``here`` (set by ``launch/common.sh``): ``train --check`` checks the host rules for this host even for a config
naming ``train.device=cuda`` (``config.host.Host.checks_declared_gpu``)."""


REFUSAL_WAIT_S = 60.0
"""How long a local rank other than 0 waits before exiting on a refused run (see ``_refusal``)."""


def _refusal(exc: Exception, *, wait: bool = True) -> int:
    """Print a refused run once: on the first local rank of each node (every worker of a node sees
    the same config, dataset and checkpoint), never once per rank; exit status 2.

    Before the process groups (``wait``) the other local ranks wait before exiting: torchrun stops
    a node's workers as soon as one exits, and must not stop local rank 0 before it has printed.
    Local rank 0's exit ends the wait (torchrun then stops them), so it costs nothing unless local
    rank 0 has hung. A refusal the ranks reach together in the run (a collective verdict, e.g. on a
    checkpoint's checksums) needs no wait: every rank returns at once."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"megatron-pack train: {exc}", file=sys.stderr, flush=True)
    elif wait:
        time.sleep(REFUSAL_WAIT_S)
    return 2


def run_line(cfg, state, dataset, validation) -> str:
    """The one console line a run starts with (the resolved config itself is written to the run folder)."""
    t, m = cfg.train, cfg.model
    steps = f"{t.train_iters} steps" if t.train_iters is not None else f"{t.num_epochs} epochs"
    batch = f"{t.global_batch_tokens} tokens" if t.global_batch_tokens is not None else f"{t.global_batch_size} packs"
    model = f"{m.name} ({m.num_layers} layers, hidden {m.hidden_size}"
    model += f", from {m.pretrained})" if m.pretrained else ")"
    model += " + LoRA" if cfg.peft.method == "lora" else ""
    layout = "; ".join(p for p in state.dims.describe().split("; ") if p.startswith(("world", "experts")))  # with EP
    chunks = cfg.parallel.virtual_pipeline_model_parallel_size
    if chunks:  # virtual stages: "pp 2" alone read as 2 stages of the layers
        pp = state.dims.pp
        layout = layout.replace(f"x pp {pp}", f"x pp {pp} (x {chunks} virtual: {pp * chunks} stages, {chunks} model "
                                              f"chunks a rank)", 1)
    return (f"run {t.output_dir}: {steps} of {batch}, lr {t.lr:.2e} | model {model} | parallel layout: {layout} | "
            f"{describe_data(dataset, validation)} | resolved config: {t.output_dir}/config.yaml")


def describe_data(dataset, validation) -> str:
    """``plan P (N packs); validation V (M packs)``: what the run trains and evaluates on."""
    plan = getattr(dataset, "plan_dir", None)
    text = f"plan {plan} ({len(dataset)} packs)" if plan is not None else _unplanned_text(dataset)
    if validation is not None:
        text += f"; validation {validation.plan_dir} ({len(validation)} packs)"
        recorded = (getattr(dataset, "metadata", {}).get("manifest") or {}).get("data.validation")
        if recorded:
            text += f" from {recorded['input']}"
    return text


def _unplanned_text(dataset) -> str:
    """Online packs (made while training) or in-batch micro-batches: where they come from."""
    meta = getattr(dataset, "metadata", None) or {}
    if meta.get("mode") == "online":
        cfg = dataset.cfg
        where = (f"the token store {cfg.data.dataset_dir}" if cfg.packing.online_source == "store"
                 else f"{cfg.data.input or 'synthetic records'} (tokenized while training)")
        return f"online packs of {meta['pack_size']} tokens from {where}"
    return f"in-batch micro-batches from {getattr(dataset, 'dataset_dir', 'the token store')}"


def main(argv: list[str]) -> int:
    from megatron_pack.cli.args import parse_command_line, print_resolved
    from megatron_pack.cli.launch import worker_started
    from megatron_pack.cli.preflight import check_images, check_train
    from megatron_pack.cli.run_config import load_run_config
    from megatron_pack.config.host import Host
    from megatron_pack.config.validate import config_warnings

    check_only = CHECK_FLAG in argv
    line = parse_command_line("train", [a for a in argv if a != CHECK_FLAG])
    if isinstance(line, int):  # --help / --version answer without importing torch
        return line
    if not check_only:
        worker_started()  # under torchrun: die with the agent; stop signals recorded from here on
    else:  # a config check (the launch scripts run it before torchrun): the run itself warns, once
        import warnings

        warnings.simplefilter("ignore")
    from megatron_pack.data.batches.opening import open_validation
    from megatron_pack.training.memory_estimate import memory_line
    from megatron_pack.training.resume import check_resume  # the check imports no torch (a fast --check)

    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    # a plain --check may be for another host (a cluster's config on a laptop); the launch scripts' is for this one
    for_declared_host = (check_only or line.print_config) and os.environ.get(CHECK_HOST_ENV) != "here"
    host = Host.probe(checks_declared_gpu=for_declared_host)
    # --cfg job outside torchrun prints the config without the world-size rules (no world yet)
    checked_world = None if line.print_config and "WORLD_SIZE" not in os.environ else world_size
    try:
        run = load_run_config(line.overrides, config_dirs=line.config_dirs, world_size=checked_world,
                              open_data=not line.print_config, host=host, command="train")
        if line.print_config:
            return print_resolved(run.cfg, "\n".join(run.notes) or None)
        cfg, dataset = run.cfg, run.dataset
        check_train(cfg, values=check_only)  # the model folder's files, before any process group
        validation = open_validation(cfg, dataset)
        check_images(dataset, validation)  # every image file the packs use, as prepare recorded it
        passed_over: list[str] = []
        resume = check_resume(cfg, world_size, dataset, notes=passed_over)
    except (ConfigError, DataError) as exc:
        return _refusal(exc)
    launch_check = check_only and os.environ.get(CHECK_HOST_ENV) == "here"  # the launch scripts': the run says them
    if rank == 0 and not launch_check:
        for warning in config_warnings(cfg):  # runs, but most likely not as meant: said once, before launch
            print(f"megatron-pack train: warning: {warning}", file=sys.stderr, flush=True)
    if check_only:
        print(f"megatron-pack train: config ok for {world_size} rank(s); {describe_data(dataset, validation)}"
              + (f"; resumes from {resume}" if resume else ""), flush=True)
        print(f"megatron-pack train: {memory_line(cfg, world_size, host.for_device(cfg.train.device))}", flush=True)
        if host.for_device(cfg.train.device) is not host:
            print("megatron-pack train: checked for the GPU host train.device=cuda names (with Transformer Engine); "
                  "this host has no GPU, so the run itself would be refused here", flush=True)
        for line in passed_over:  # damaged newer checkpoints: said once, before launch
            print(f"megatron-pack train: {line}", file=sys.stderr, flush=True)
        return 0
    from megatron_pack.cli.launch import hide_gpus_for_cpu_run

    hide_gpus_for_cpu_run(cfg.train.device)  # before anything starts CUDA: train.device=cpu sees no GPU
    from megatron_pack.model.cpu_compat import eager_jit_fuser_without_cuda

    eager_jit_fuser_without_cuda()  # before megatron-core's first import: no torch.compile machinery on CPU
    from megatron_pack.training.eval import build_validation_loader
    from megatron_pack.training.loop import build_loader, run_training
    from megatron_pack.training.summary import next_step_lines, run_summary
    from megatron_pack.training.signals import DATA_STOP_NAME, configure, data_problem

    configure(cfg.checkpoint.save_on_signal, list(cfg.checkpoint.signals))
    _setup_logging(cfg.logging.level, rank)
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    enable_cpu_compat_without_cuda()  # megatron-core's CUDA assumptions, answered on a CPU host
    _freeze_garbage_collection()
    try:
        state = initialize_parallel(cfg)
    except ConfigError as exc:  # this node's GPUs cannot hold its ranks (parallel.groups.resolve_device): one line
        return _refusal(exc)
    if rank == 0:  # the whole resolved config goes to <train.output_dir>/config.yaml and run.json
        print(run_line(cfg, state, dataset, validation), flush=True)
        if run.notes:
            print(f"settings from the dataset ({run.plan_dir or cfg.data.dataset_dir}): "
                  + ", ".join(n.split(": ", 1)[-1] for n in run.notes), flush=True)
    try:
        trainer = run_training(cfg, state, build_loader(cfg, state, dataset),
                               validation=build_validation_loader(cfg, state, validation))
    except FloatingPointError as exc:  # non-finite weights or loss: every rank stopped at the same point
        print(f"megatron-pack train: {exc}", file=sys.stderr, flush=True)
        return 1
    except ConfigError as exc:  # reached by every rank together (a verdict on a checkpoint's checksums)
        return _refusal(exc, wait=False)
    finally:
        destroy_parallel(destroy_process_group=True)
    if trainer.stopped_by == DATA_STOP_NAME:  # every rank: the ranks that read the problem say it, once a DP rank
        if data_problem() and state.tp_rank == 0 and state.cp_rank == 0 and state.pp_rank == 0:
            print(data_stop_line(trainer, data_problem()), file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(run_summary(cfg, dataset), flush=True)
        if trainer.stopped_by:
            print(stop_line(trainer), flush=True)
        elif trainer.step >= trainer.train_iters:  # finished: the next step is the export of its checkpoint
            for line in next_step_lines(cfg):
                print(line, flush=True)
    return 0


def _freeze_garbage_collection() -> None:
    """Collect, then leave every object alive now (the imports: about 400,000 with torch and megatron-core) out of
    later collections (``gc.freeze``): the collection ``destroy_parallel`` runs at the end then scans only what the
    run made (0.2 CPU-s a rank otherwise). The collection first: the garbage of an earlier run in this process (a
    notebook, ``_train_cases.py``) is freed, not frozen."""
    import gc

    gc.collect()
    gc.freeze()


def stop_line(trainer) -> str:
    """``megatron-pack train: stopped by SIGTERM after step 7 of 50: saved checkpoint ...; ...``."""
    saved = (f"saved checkpoint {trainer.stop_checkpoint}; run the same command to resume from it"
             if trainer.stop_checkpoint else "checkpoint.enabled=false, so nothing was saved")
    return (f"megatron-pack train: stopped by {trainer.stopped_by} after step {trainer.step} of "
            f"{trainer.train_iters}: {saved}.")


def data_stop_line(trainer, problem: str) -> str:
    """``megatron-pack train: sample 12 (chat.jsonl: line 13): image 0 (...) changed since prepare ...; stopped after
    step 3 of 50, saved checkpoint ...``: a run stopped by data it cannot train on (``training.signals``)."""
    saved = (f"saved checkpoint {trainer.stop_checkpoint} (this sample's loss left out of step {trainer.step}); "
             "once the image is back, run the same command to resume from it" if trainer.stop_checkpoint
             else "checkpoint.enabled=false, so nothing was saved")
    return f"megatron-pack train: {problem.rstrip('.')}; stopped after step {trainer.step} of {trainer.train_iters}: {saved}."


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
