"""Every test session runs in a scratch working folder: no test reads or writes the working folder it was
started from (a checkout where the README's quickstart left ``runs/`` and ``data/``). Paths a config gives
relative to the working folder (``train.output_dir=runs/quickstart``, ``data.dataset_dir=data/synthetic``)
land in the scratch folder; a test that needs a folder of its own still makes one (``tmp_path``)."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _scratch_working_folder(tmp_path_factory):
    started_in = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("working_folder"))
    try:
        yield
    finally:
        os.chdir(started_in)
