"""megatron_pack: packed-sequence SFT in the THD layout with context parallelism, on megatron-core."""

import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithPresets(build_py):
    """Also copy the presets of configs/ (config.yaml, <group>/<name>.yaml) into the wheel as package data
    of megatron_pack.config (presets/), so an installed package finds them from any folder; a source
    checkout or an editable install reads configs/ in place (megatron_pack/config/search_path.py)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "megatron_pack" / "config" / "presets"
        for src in sorted((ROOT / "configs").glob("**/*.yaml")):
            dest = target / src.relative_to(ROOT / "configs")
            self.mkpath(str(dest.parent))
            self.copy_file(str(src), str(dest))


# megatron-core 0.16.1 is the newest release that installs on Python 3.11; newer Pythons may take newer.
MCORE = "megatron-core==0.16.1" if sys.version_info < (3, 12) else "megatron-core>=0.16.1"

setup(
    name="megatron_pack",
    version="0.1.0",
    description="Packed-sequence SFT (THD layout, context parallelism) on megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_pack", "megatron_pack.*"]),
    include_package_data=True,
    cmdclass={"build_py": BuildPyWithPresets},  # configs/ -> megatron_pack/config/presets/ in the wheel
    install_requires=[
        "torch>=2.4,<2.15",  # 2.13.0 (the CPU wheel installed first by scripts/setup.sh) satisfies this
        MCORE,
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "numpy>=1.24",
        "pyarrow>=14",
        "tqdm>=4.60",
        "pillow>=10.1",  # report.png (ImageFont.load_default(size=)) and image records
        "tensorboard>=2.14",
        "safetensors>=0.4",  # model.pretrained: streamed, TP-sliced loading (megatron_pack.model.hf)
    ],
    extras_require={
        "test": ["pytest>=7.4", "hypothesis>=6.90", "pytest-timeout>=2.2", "transformers>=4.40", "tokenizers>=0.19", "jinja2>=3.1",
                 "peft>=0.13",  # tests/functional/test_lora_*: the reference LoRA implementation
                 "pytest-xdist>=3.5",  # scripts/test.sh: unit modules beside the worlds (tests/conftest.py)
                 # logging.wandb / logging.mlflow, tested offline; mlflow-skinny is mlflow without its server and UI
                 "wandb>=0.17", "mlflow-skinny>=2.10"],
        "hf": ["transformers>=4.40", "tokenizers>=0.19", "jinja2>=3.1"],
        "wandb": ["wandb>=0.17"],  # logging.wandb=true
        "mlflow": ["mlflow-skinny>=2.10"],  # logging.mlflow=true (the full mlflow package works too)
        # apex has no PyPI release: build it from source (docs/model.md) after installing this extra.
        # Transformer Engine 2.0 to 2.20: their DotProductAttention takes pad_between_seqs, which the TE layer spec
        # passes for tail-padded THD packs (model/te_attention.py; TE issue #3331, seen on 2.16.0 and 2.17.1, took a
        # wrong CP path when left to guess). A newer TE is admitted after tests/gpu/run.sh's te_thd_cp2 passes on it.
        "gpu": ["transformer-engine[pytorch]>=2.0,<2.21"],
        # the linear-attention layers' GPU kernel (model/delta_rule.py: chunk_gated_delta_rule with cu_seqlens),
        # imported guarded; without it those layers run the torch kernel. Not yet run on a GPU by tests/gpu.
        "fla": ["flash-linear-attention>=0.3"],
        # bench/ only, never CI: TRL and datasets are the peers of bench/prepare.py --real, mistral-common
        # ships the real tokenizers it reads, sentencepiece converts Mistral's tokenizer.model
        "bench": ["trl>=0.19", "datasets>=2.19", "psutil>=5.9", "mistral-common>=1.5", "sentencepiece>=0.1.99"],
    },
    entry_points={"console_scripts": ["megatron-pack=megatron_pack.cli.main:main"]},
)
