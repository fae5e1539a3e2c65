#!/usr/bin/env bash
# The DeepSpeed venv the benches run their reference modes in (bench/ds_e2e.py under bench/e2e.py,
# bench/zero.py and bench/scale.py): its own venv, since DeepSpeed is never a dependency of ours.
#
#   bash bench/ds_venv.sh [DIR]        # default /work/dsvenv; the benches find DIR/bin/python there
#                                      # (elsewhere: OFFLOAD_DS_PYTHON=DIR/bin/python or --ds-python)
#
# What goes in:
#   torch==2.13.0        the version of our own venv; the pin takes the local CPU wheel where there is one
#                        (pip's find-links): a plain `torch` may pull a multi-GB CUDA build
#   deepspeed==0.19.8    the version bench/RESULTS.md's figures are of (DEEPSPEED_VERSION to change it);
#                        built with no ops: DeepSpeed JIT-builds CPUAdam and async_io on first use (ninja, g++)
#   numpy psutil pyyaml ninja tqdm   what our `offload` package imports: ds_e2e.py imports it from this
#                        checkout through PYTHONPATH (bench/e2e.py's worker_env), it is not installed here
#   transformers safetensors         ds_generate.py's model (bench/generate.py's ZeRO-Inference column), the
#                        transformers version of our own venv (TRANSFORMERS_VERSION to change it)
# and, from Debian, libaio-dev: the header DeepSpeed's async_io op (its NVMe offload) compiles against.
set -euo pipefail

DIR="${1:-/work/dsvenv}"
PYTHON="${PYTHON:-python3}"
DEEPSPEED_VERSION="${DEEPSPEED_VERSION:-0.19.8}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.25.0}"

if [ ! -e /usr/include/libaio.h ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq libaio-dev
    else
        echo "ds_venv.sh: /usr/include/libaio.h missing: DeepSpeed's NVMe offload (async_io) needs it;" \
             "install libaio-dev (apt-get install libaio-dev) and run again" >&2
        exit 1
    fi
fi

"$PYTHON" -m venv "$DIR"
PIP=("$DIR/bin/python" -m pip install --quiet)
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" numpy psutil pyyaml ninja tqdm "transformers==$TRANSFORMERS_VERSION" safetensors
# No build isolation: DeepSpeed's setup.py imports the torch installed above; DS_BUILD_OPS=0 leaves its
# C++ ops to the JIT, DS_ACCELERATOR=cpu the CPU accelerator the benches run it on.
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "${PIP[@]}" --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"

# The check the benches rely on: DeepSpeed imports on its CPU accelerator and sees async_io's requirements.
DS_ACCELERATOR=cpu "$DIR/bin/python" - <<'EOF'
import deepspeed, torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import AsyncIOBuilder
print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, accelerator {get_accelerator()._name}, "
      f"async_io compatible: {AsyncIOBuilder().is_compatible()}")
EOF
echo "$DIR/bin/python"
