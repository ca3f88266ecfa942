"""Open a prepared dataset for a config: the training packs and the validation packs (torch-free).

``train --check`` opens both before launch (so a damaged or missing plan is refused once, exit
2), which is why this module imports no torch; the loaders that turn them into batches are in
``loader.py``. Online packing's source (``online.OnlineSource``) is imported only when used.
"""

from __future__ import annotations

from pathlib import Path

from megatron_pack.config.schema import Config
from megatron_pack.data.batches.dataset import PackedSFTDataset
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

        return OnlineSource(cfg)
    if cfg.packing.mode == "in_batch":
        return MicroBatchDataset.from_config(cfg, check_tokenizer=check_tokenizer)
    return PackedSFTDataset.from_config(cfg, plan_dir=plan_dir, check_tokenizer=check_tokenizer)


def open_validation(cfg, train_dataset=None):
    """The validation ``PackedSFTDataset`` of ``cfg`` or None when it has none.

    ``data.validation``: the plan prepared in ``<data.dataset_dir>/validation`` with the training
    plan's settings; ``data.validation_fraction``: the ``validation`` sub-plan of the training
    plan (``train_dataset``'s, opened from ``cfg`` when not given). Raises ``DataError`` naming
    the prepare command when it is missing.
    """
    from megatron_pack.data.formats.sources import DataError
    from megatron_pack.data.store.metadata import VALIDATION_DIRNAME

    if cfg.data.validation is not None:
        from megatron_pack.data.prepare import validation_config

        return PackedSFTDataset.from_config(validation_config(cfg))
    if not cfg.data.validation_fraction:
        return None
    train_dataset = train_dataset or PackedSFTDataset.from_config(cfg)
    plan_dir = Path(train_dataset.plan_dir) / VALIDATION_DIRNAME
    if not (plan_dir / "metadata.json").is_file():
        raise DataError(f"the packing plan {train_dataset.plan_dir} has no held-out validation plan for "
                        f"data.validation_fraction={cfg.data.validation_fraction}; re-run `megatron-pack prepare` "
                        "with the same config.")
    dataset = PackedSFTDataset(train_dataset.dataset_dir, plan_dir, expected_tokenizer=cfg.data.tokenizer)
    if "mixture" in dataset.metadata:  # written before held-out samples were packed each once
        raise DataError(f"the validation plan {plan_dir} was written by an older prepare that resampled the held-out "
                        "samples to the data.sources shares (some never evaluated, others repeated); delete "
                        f"{train_dataset.plan_dir} and re-run `megatron-pack prepare` with the same config.")
    return dataset

