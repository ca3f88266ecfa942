"""Open a prepared dataset for a config: the training packs and the validation packs (torch-free).

``train --check`` opens both before launch (so a damaged or missing plan is refused once, exit
2), which is why this module imports no torch; the loaders that turn them into batches are in
``loader.py``. Online packing's source (``online.OnlineSource``) is imported only when used.
"""

from __future__ import annotations

from pathlib import Path

from megatron_pack.config.schema import Config
from megatron_pack.data.batches.dataset import PackedSFTDataset, _expected_tokenizer
from megatron_pack.data.batches.micro_batches import MicroBatchDataset


def open_dataset(cfg: Config, *, plan_dir=None, check_tokenizer: bool = True
                 ) -> PackedSFTDataset | MicroBatchDataset:
    """The prepared packed dataset for ``cfg`` (raises ``DataError`` naming the prepare command);
    with ``packing.mode=online`` the ``OnlineSource`` its packs are made from; with
    ``packing.mode=in_batch`` the token store as micro-batches of ``train.micro_batch_size`` samples.

    ``plan_dir`` is the plan ``megatron_pack.data.store.recorded.choose_plan`` picked (default: the
    one named by ``cfg.packing``); ``check_tokenizer=False`` when ``data.tokenizer`` was read from
    the dataset itself (``megatron_pack.cli.run_config``).
    """
    if cfg.packing.mode == "online":
        from megatron_pack.data.batches.online import OnlineSource

        return OnlineSource(cfg, recorded_plan=plan_dir)
    if cfg.packing.mode == "in_batch":
        return MicroBatchDataset.from_config(cfg, check_tokenizer=check_tokenizer)
    return PackedSFTDataset.from_config(cfg, plan_dir=plan_dir, check_tokenizer=check_tokenizer)


def open_validation(cfg, train_dataset=None):
    """The validation ``PackedSFTDataset`` of the training plan, or None when it has none.

    The training plan's manifest says which (``data.validation``: the plan prepared from that file, recorded
    with its folder under ``<data.dataset_dir>/validation``; ``data.validation_fraction``: the plan's own
    ``validation`` sub-plan), so train needs neither key repeated. It is checked against the training store's
    tokenizer identity (chat template included), never against a tokenizer rebuilt from the command line.
    ``train_dataset`` is opened from ``cfg`` when not given; one without a manifest (online, in-batch) falls
    back to ``cfg``'s keys. Raises ``DataError`` naming the prepare command when it is missing.
    """
    train_dataset = train_dataset if train_dataset is not None else PackedSFTDataset.from_config(cfg)
    manifest = getattr(train_dataset, "metadata", {}).get("manifest")
    if manifest is None:
        return _validation_from_config(cfg, train_dataset)
    identity = train_dataset.store_metadata["tokenizer"]
    if manifest.get("data.validation"):
        return _validation_file(train_dataset, manifest["data.validation"], identity)
    if manifest.get("data.validation_fraction"):
        return _held_out(train_dataset.dataset_dir, Path(train_dataset.plan_dir), identity)
    return None


def _held_out(dataset_dir, train_plan: Path, identity):
    """The held-out validation plan ``<train_plan>/validation`` of a plan prepared with data.validation_fraction."""
    from megatron_pack.data.formats.sources import DataError
    from megatron_pack.data.store.metadata import VALIDATION_DIRNAME

    plan_dir = train_plan / VALIDATION_DIRNAME
    if not (plan_dir / "metadata.json").is_file():
        raise DataError(f"the packing plan {train_plan} records a data.validation_fraction but has no "
                        f"held-out validation plan {plan_dir}; delete {train_plan} and re-run "
                        "`megatron-pack prepare` with the same config.")
    dataset = PackedSFTDataset(dataset_dir, plan_dir, expected_tokenizer=identity)
    if "mixture" in dataset.metadata:  # written before held-out samples were packed each once
        raise DataError(f"the validation plan {plan_dir} was written by an older prepare that resampled the held-out "
                        "samples to the data.sources shares (some never evaluated, others repeated); delete "
                        f"{train_plan} and re-run `megatron-pack prepare` with the same config.")
    return dataset


def _validation_file(train_dataset, recorded: dict, identity):
    """The plan ``prepare data.validation=FILE`` wrote, checked to hold that file's records."""
    from megatron_pack.data.formats.sources import DataError

    plan_dir = Path(train_dataset.dataset_dir) / recorded.get("plan", "<missing>")
    redo = (f"re-run `megatron-pack prepare data.dataset_dir={train_dataset.dataset_dir} "
            f"data.validation={recorded['input']} ...` with the training plan's settings")
    if not (plan_dir / "metadata.json").is_file():
        raise DataError(f"the training plan {train_dataset.plan_dir} was prepared with data.validation="
                        f"{recorded['input']}, but its validation plan {plan_dir} is missing; {redo}.")
    dataset = PackedSFTDataset(plan_dir.parent.parent, plan_dir, expected_tokenizer=identity)
    files = [{"name": Path(f["path"]).name, "sha256": f.get("sha256")}
             for f in dataset.store_metadata["sources"].get("files", [])]
    if sorted(files, key=str) != sorted(recorded["files"], key=str):
        raise DataError(f"the validation store {plan_dir.parent.parent} holds other records than data.validation="
                        f"{recorded['input']} had when the training plan {train_dataset.plan_dir.name} was prepared "
                        f"(another prepare replaced it); {redo}.")
    return dataset


def _validation_from_config(cfg, train_dataset):
    """Online and in-batch runs (no training plan): the validation set the config names."""
    if cfg.data.validation is not None:
        from megatron_pack.data.prepare import validation_config

        return PackedSFTDataset.from_config(validation_config(cfg))
    if not cfg.data.validation_fraction:
        return None
    if cfg.packing.mode == "online":  # the held-out samples of the plan whose manifest completed cfg
        return _online_held_out(cfg, train_dataset)
    return _held_out(train_dataset.dataset_dir, Path(train_dataset.plan_dir), _expected_tokenizer(cfg))


def _online_held_out(cfg, source):
    """Online packing from a prepared store: the validation plan of the samples its stream leaves out."""
    from megatron_pack.data.formats.sources import DataError

    if source.held_out_plan is None:
        raise DataError(f"data.validation_fraction ({cfg.data.validation_fraction}) with packing.mode=online "
                        "holds out samples of a prepared store; run `megatron-pack prepare data.dataset_dir="
                        f"{cfg.data.dataset_dir} data.validation_fraction={cfg.data.validation_fraction}` and train "
                        "with packing.online_source=store, or set data.validation=FILE.")
    return _held_out(cfg.data.dataset_dir, source.held_out_plan.parent, source.metadata["tokenizer"])
