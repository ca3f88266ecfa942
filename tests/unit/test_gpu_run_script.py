"""tests/gpu/run.sh runs on a CPU machine: every GPU check is skipped with its reason, exit status 0."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "gpu" / "run.sh"


def _checks():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "tests" / "gpu" / "checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no torch, megatron or transformer_engine at import time
    return module


def test_run_sh_on_cpu_skips_every_check_and_exits_0(tmp_path):
    checks = _checks()
    env = {**os.environ, "PYTHON": sys.executable, "MEGATRON_PACK_GPU_WHEELS": str(tmp_path / "no_wheels"),
           "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", str(RUN)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    names = [name for name, _ in checks.CHECKS]
    assert names == ["torch_thd_core", "te_thd_attention", "te_thd_cp2", "cuda_graph_loop", "bf16_loss_parity",
                     "fp8_shapes", "trainer_world1", "dist_optimizer_world1", "verify_transformers", "two_ranks_gloo"]
    for name in names:
        assert f"SKIP {name}: needs one GPU; no CUDA device" in out.stdout
        assert f"| {name} | SKIP |" in out.stdout  # and its row in the one table
    assert "no GPU on this machine, every check skipped" in out.stdout
    assert "no wheels in" in out.stdout
    assert "[run.sh] preflight: " in out.stdout  # the preflight ran (and found what the four commands import)


def test_check_timeouts_fit_the_10_minute_budget():
    checks = _checks()
    assert sum(t for _, t in checks.CHECKS) <= 540  # run.sh's install and start-up fit in what is left of 600 s
    for script in ("run.sh", "download_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "tests" / "gpu" / script)], check=True)


def test_checks_import_no_torch():
    """run.sh reads the check list before anything is installed: checks.py and check_trainer.py import torch lazily."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('gpu_checks', sys.argv[1]); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "assert callable(module.check_two_ranks_gloo); "
            "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests" / "gpu" / "checks.py")], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def _preflight():
    spec = importlib.util.spec_from_file_location("gpu_preflight", ROOT / "tests" / "gpu" / "preflight.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports nothing it checks at import time
    return module


def _imported_by_the_package() -> dict[str, str]:
    """Every third-party top-level module megatron_pack imports anywhere (lazy imports included) -> one file."""
    import ast

    found: dict[str, str] = {}
    for path in sorted((ROOT / "megatron_pack").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "megatron_pack":
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_preflight_covers_every_import_of_the_package():
    """A module the package imports is either checked by run.sh's preflight or named optional (with why): a new
    import cannot make run.sh fail after its preflight passed on a bare GPU machine."""
    preflight = _preflight()
    checked = {module.split(".")[0] for module in preflight.NEEDED} | set(preflight.OPTIONAL)
    imported = _imported_by_the_package()
    assert {"torch", "megatron", "hydra", "PIL", "tqdm"} <= set(imported)  # the scan reads the real imports
    unchecked = {m: f for m, f in imported.items() if m not in checked}
    assert not unchecked, f"imports neither in tests/gpu/preflight.py's NEEDED nor OPTIONAL: {unchecked}"


def test_download_wheels_carries_what_the_image_lacks():
    import re

    preflight = _preflight()
    text = (ROOT / "tests" / "gpu" / "download_wheels.sh").read_text(encoding="utf-8")
    carried = {re.sub(r"[-_.]+", "-", m.lower()) for m in re.findall(r"([A-Za-z][\w.-]*)(?:==[\w.]+)", text)}
    needed = {re.sub(r"[-_.]+", "-", d.lower()) for d in preflight.NEEDED.values()}
    image = {re.sub(r"[-_.]+", "-", d.lower()) for d in preflight.IMAGE}
    assert "megatron-core" in carried and "pillow" in carried  # the pattern reads the download line
    assert needed - image <= carried, f"neither in the image nor carried: {sorted(needed - image - carried)}"
    # what tensorboard imports travels with it (pip download --no-deps fetches nothing else)
    assert {"pillow", "grpcio", "protobuf", "absl-py", "markdown", "werkzeug", "markupsafe",
            "tensorboard-data-server"} <= carried
