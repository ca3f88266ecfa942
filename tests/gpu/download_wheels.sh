#!/usr/bin/env bash
# Download, here (PyPI reachable), the wheels tests/gpu/run.sh installs on a GPU machine that has only
# torch (and the usual numpy / PyYAML / packaging) and no network, into .whl/ (gitignored; the device
# tool carries it: carry [".whl"]).
#
#   bash tests/gpu/download_wheels.sh                 # megatron-core and Hydra for CPython 3.12, x86-64
#   PY_VERSION=3.11 bash tests/gpu/download_wheels.sh # another target Python
#   WITH_TE=1 bash tests/gpu/download_wheels.sh       # also Transformer Engine's Python package and core library
#
# What it fetches: everything prepare, train, verify and export import that the bare image lacks (run.sh's
# preflight imports the same list): megatron-core 0.16.1 (binary, cp312), hydra-core 1.3.2, omegaconf 2.3.0 and
# antlr4-python3-runtime 4.9.3 (PyPI has only its source archive, built into a pure-Python wheel here); tqdm
# (the token store's and validation's progress); pillow (prepare's report.png, image records); tensorboard and what
# it imports (train's logging.tensorboard=true, the default: absl-py, grpcio, markdown, protobuf, setuptools,
# tensorboard-data-server, werkzeug, markupsafe). The versions are the ones CI runs. Measured total: 41.9 MiB of
# the device tool's 64 MiB when matplotlib and what it imports travelled too (before report.png was drawn with
# Pillow alone; not measured since); the script prints the total and refuses more than 60 MiB.
#
# Transformer Engine cannot travel this way: transformer_engine_cu13 (the core library) is a 276 MB
# wheel, over the device tool's 64 MiB per call, and transformer_engine_torch (its PyTorch extension)
# is published only as a source archive that compiles against the target's torch and CUDA. With
# WITH_TE=1 the first two are downloaded (for a machine you copy them to yourself); build the third
# on the GPU machine with its torch and nvcc:
#   python3 -m pip wheel --no-deps --no-build-isolation -w .whl transformer-engine-torch==2.20.2
# Without Transformer Engine, run.sh skips the checks that need it and says so.
#
# transformers, tokenizers and safetensors (the tiny pretrained folder, verify's reference) are not carried:
# the GPU machine's image has them (transformers 5.17, tokenizers 0.23, safetensors 0.8). The versions here
# would not install beside it with --no-deps: transformers 5.25 needs huggingface-hub 2.4, which needs httpx2
# and kernels that the image lacks (their four wheels are 18 MB). Without them, the checks that need them
# skip and say which import failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PYV=${PY_VERSION:-3.12}
TAG=cp${PYV/./}
WHEELS=${MEGATRON_PACK_GPU_WHEELS:-.whl}
mkdir -p "$WHEELS"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp --abi "$TAG" \
  --abi abi3 --abi none "${platforms[@]}" -d "$WHEELS" megatron-core==0.16.1 hydra-core==1.3.2 omegaconf==2.3.0 \
  tqdm==4.70.1 pillow==13.0.0 tensorboard==2.21.0 tensorboard-data-server==0.7.2 \
  absl-py==2.5.1 grpcio==1.85.4 markdown==3.11.4 protobuf==7.36.2 setuptools==84.2.1 werkzeug==3.1.9 \
  markupsafe==3.0.4
"$PY" -m pip wheel -q --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3
if [[ "${WITH_TE:-0}" == 1 ]]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${platforms[@]}" -d "$WHEELS" transformer-engine==2.20.2 transformer-engine-cu13==2.20.2
fi
ls -l "$WHEELS"
total=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1048576)) MiB in $WHEELS (the device tool carries 64 MiB; TE's wheels travel separately)"
if [[ "${WITH_TE:-0}" != 1 ]] && ((total > 60 * 1048576)); then
  echo "over 60 MiB: leave room for the working tree the device tool carries too" >&2
  exit 1
fi
echo "carry .whl with the device tool (carry: [\".whl\"]) and run: bash tests/gpu/run.sh"
