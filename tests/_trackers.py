"""Read back what the experiment trackers wrote, offline: a W&B offline run's ``.wandb`` file and an MLflow file store.

The W&B reader decodes the run file's own framing (the LevelDB log format wandb writes: a 7-byte file header
``:W&B`` + magic + version, then 32 KiB blocks of records, each with a 7-byte header of CRC32, length and type:
1 full, 2 first, 3 middle, 4 last) into wandb's protobuf ``Record``s; wandb ships the protobufs but no reader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def wandb_records(path: Path) -> list:
    """Every ``wandb_internal_pb2.Record`` of an offline run file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pos, parts = [], HEADER, []
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zero padding at the end of the file
            break
        parts.append(data[pos + HEADER:pos + HEADER + length])
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def wandb_run(output_dir: Path) -> tuple[dict[int, dict[str, float]], dict]:
    """The one offline run under ``output_dir/wandb``: its history (step -> {tag: value}) and its config."""
    runs = list((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history, config = {}, {}
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = record.history.step.num if record.history.HasField("step") else items.get("_step")
            history[int(step)] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind in ("run", "config"):  # the config given to wandb.init travels in the run record
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    config.pop("_wandb", None)
    return history, config


def mlflow_run(output_dir: Path, experiment: str = "megatron-pack") -> tuple[dict[int, dict[str, float]], dict]:
    """The one MLflow run in ``output_dir/mlruns``: its metrics (step -> {tag: value}) and its params."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(output_dir.resolve() / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, runs
    run = runs[0]
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            history.setdefault(metric.step, {})[key] = metric.value
    return history, dict(run.data.params)


def tensorboard_scalars(log_dir: Path) -> dict[int, dict[str, float]]:
    """TensorBoard's view of ``log_dir`` (purged steps dropped, as its UI shows them): step -> {tag: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


def tensorboard_steps(log_dir: Path, tag: str = "train/lm_loss") -> list[int]:
    """The steps of ``tag`` in TensorBoard's view, in the order its plot draws them (wall time order)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [event.step for event in acc.Scalars(tag)]
