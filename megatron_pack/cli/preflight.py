"""The files a command names, checked before it starts anything (torch-free).

A broken model folder used to surface inside torchrun, one traceback per rank. Here each
command checks what it will read, after its config is loaded and before any process group,
tokenizer or model exists; every problem is one line naming the file and the fix, and the command
exits 2 (``megatron-pack <command>: <line>``):

| command              | model.pretrained checked                                             |
|----------------------|----------------------------------------------------------------------|
| ``train --check``    | headers, sizes, coverage, shapes, dtypes; every weight's values      |
|                      | (NaN / Inf) unless ``model.check_pretrained_values=false``            |
| ``train`` (each rank)| headers, sizes, coverage, shapes, dtypes (each rank checks its shard's|
|                      | values on load, ``training.finite``)                                 |
| ``verify``           | headers ... and every weight's values (it reads them all anyway)      |
| ``export``           | the folder it reads weights from (a round trip, or the base of a      |
|                      | LoRA merge), as ``verify``                                            |
| ``prepare``          | headers ... (it reads no weight)                                      |

``data.tokenizer`` is checked wherever it is loaded (``build_tokenizer`` calls
``data.formats.tokenizer_files.tokenizer_folder_problem`` first): ``prepare`` checks it here too,
before hashing its input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_pack.data.formats.sources import DataError


def model_folder_problems(folder: Optional[str], *, values: bool, where: Optional[str] = None) -> list[str]:
    """The one-line problems of the Hugging Face folder ``folder`` (none when it is None or loads);
    ``values`` also reads every weight the mapping loads for NaN / Inf."""
    if folder is None:
        return []
    from megatron_pack.config.hf_config import UnsupportedModel, read_hf_config, refusal
    from megatron_pack.model.hf.folder_check import folder_problems, nonfinite_problems

    where = where or f"model.pretrained ({folder})"
    try:
        hf = read_hf_config(folder)
    except (FileNotFoundError, UnsupportedModel) as exc:
        return [str(exc)]
    problem = refusal(hf, where)
    if problem:
        return [problem]
    problems = folder_problems(folder, where=where, hf=hf)
    if values and not problems:
        problems = nonfinite_problems(folder, where=where, hf=hf)
    return problems


def tokenizer_problems(tokenizer: str) -> list[str]:
    from megatron_pack.data.formats.tokenizer_files import tokenizer_folder_problem

    problem = tokenizer_folder_problem(tokenizer)
    return [problem] if problem else []


def check(problems: list[str]) -> None:
    """Raise ``DataError`` holding the problems, one line each (the commands print it, exit 2)."""
    if problems:
        raise DataError("\n".join(problems))


def check_train(cfg, *, values: bool) -> None:
    """``train`` / ``train --check``: the model folder it starts from (``values``: read every weight)."""
    check(model_folder_problems(cfg.model.pretrained, values=values and cfg.model.check_pretrained_values))


def check_prepare(cfg) -> None:
    """``prepare``: the tokenizer it loads, and the model folder's headers when one is named."""
    check(tokenizer_problems(cfg.data.tokenizer) + model_folder_problems(cfg.model.pretrained, values=False))


def check_weights_folder(folder: Optional[str | Path], where: Optional[str] = None) -> None:
    """``verify`` and ``export``: a folder whose weights are read in this one process (values too)."""
    check(model_folder_problems(None if folder is None else str(folder), values=True, where=where))


def check_images(*datasets) -> None:
    """``train`` and ``verify``: every image file the datasets' packs use (a plan's samples, or the whole store for
    online packing) still exists with the pixel size prepare recorded, before any process group: an image deleted
    or replaced after prepare was found only when its pack was read, after steps that were then lost."""
    from megatron_pack.data.store.images import changed_images

    problems, count = [], 0
    for dataset in datasets:
        store = getattr(dataset, "store", None)
        if store is None or store.images is None:
            continue
        order = getattr(dataset, "sample_order", None)
        found, n = changed_images(store.images, order if order is not None else range(len(store)),
                                  store.metadata["images"], store.where)
        problems, count = problems + found[:3 - len(problems)], count + n
    if count:
        raise DataError(f"{count} image file(s) the training data uses changed since prepare: " + "; ".join(problems)
                        + ("; ..." if count > len(problems) else "") + ". Put the images back as they were, or re-run "
                        "`megatron-pack prepare` with data.overwrite=true to prepare the data as it is now.")
