"""run.sh's preflight: import what ``prepare``, ``train``, ``verify`` and ``export`` import, before any check runs.

``NEEDED`` maps each module to the distribution that provides it: measured by running the four commands on a CPU
with ``PYTHONPROFILEIMPORTTIME=1`` (quickstart prepare, two train steps with TensorBoard, verify, export of a tiny
folder) and keeping the imports that must succeed; ``tests/unit/test_gpu_run_script.py`` holds it against every
module ``megatron_pack`` imports. ``IMAGE`` is what the bare GPU machine's image has; ``download_wheels.sh`` carries
the rest. ``OPTIONAL`` lists the imports a check or a feature may lack (each check that needs one skips, naming it).

Prints ``missing: <module> (<distribution>) ...`` and exits 2 when one does not import; 0 otherwise.
"""

from __future__ import annotations

import importlib
import sys

NEEDED = {
    "torch": "torch", "numpy": "numpy", "yaml": "PyYAML", "packaging": "packaging",
    "megatron.core": "megatron-core", "hydra": "hydra-core", "omegaconf": "omegaconf",
    "antlr4": "antlr4-python3-runtime",
    "tqdm": "tqdm",  # the token store's and validation's progress
    "PIL": "pillow",  # prepare's report.png, image records
    "torch.utils.tensorboard": "tensorboard",  # train's logging.tensorboard=true (the default)
    "safetensors.torch": "safetensors",  # model.pretrained folders, export
}
"""Module -> distribution of every import the four commands cannot run without."""

IMAGE = {"torch", "numpy", "PyYAML", "packaging", "safetensors", "transformers", "tokenizers"}
"""Distributions the bare GPU machine's image has (Python 3.12, torch 2.11; transformers 5.17, tokenizers 0.23,
safetensors 0.8); the others in ``NEEDED`` travel as wheels (``download_wheels.sh``)."""

OPTIONAL = {
    "transformer_engine": "the TE checks skip without it (its wheels exceed what the device tool carries)",
    "transformers": "verify.reference=transformers and the Hugging Face tokenizers (the checks use the byte tokenizer)",
    "tokenizers": "Hugging Face tokenizers", "jinja2": "chat templates", "pyarrow": "Parquet and Arrow inputs",
    "wandb": "logging.wandb", "mlflow": "logging.mlflow", "fused_weight_gradient_mlp_cuda": "apex's fused wgrad",
    "fla": "flash-linear-attention's packed delta-rule kernels (linear attention falls back to its torch path)",
}
"""Modules ``megatron_pack`` imports only for a feature the checks do not use, or guards with a fallback."""


def missing() -> list[str]:
    gone = []
    for module, dist in NEEDED.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install raising anything else
            gone.append(f"{module} ({dist}: {type(exc).__name__}: {str(exc)[:80]})")
    return gone


if __name__ == "__main__":
    problems = missing()
    if problems:
        print("[run.sh] missing: " + "; ".join(problems) + "; carry them with tests/gpu/download_wheels.sh",
              file=sys.stderr)
        sys.exit(2)
    print(f"[run.sh] preflight: {len(NEEDED)} imports of prepare, train, verify and export found")
