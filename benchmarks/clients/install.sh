#!/usr/bin/env bash
# Install the real-client lane's environment: a SEPARATE venv (default .venv-clients) holding this package and the
# pinned Lightning-based libraries the lane trains with. Usage: benchmarks/clients/install.sh [VENV_DIR]
#
# Every pip call keeps `-c constraints.txt` (torch==2.13.0, a CPU build): without it pip pulls a multi-GB CUDA torch.
# torchvision: lightly requires it and imports it at module level, but PyPI's Linux torchvision wheels are CUDA builds
# whose compiled ops cannot load beside the CPU torch ("operator torchvision::nms does not exist" on import). We
# install the matching PyPI torchvision anyway (so pip's metadata is consistent and its pure-Python modules exist) and
# benchmarks/clients/tv_shim.py makes it importable without its compiled ops (none of which the lane calls).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv-clients}"
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q -c constraints.txt -e . \
    neuralforecast==3.3.0 pytorch-forecasting==1.8.0 lightly==1.6.0 torchvision==0.28.0
python - <<'PY'
import sys; sys.path.insert(0, "benchmarks/clients")
import tv_shim; tv_shim.install()
import neuralforecast, pytorch_forecasting, lightly, torch, lightning_overflow
from lightly.loss import NTXentLoss, SwaVLoss
print("client lane ready: torch", torch.__version__, "neuralforecast", neuralforecast.__version__,
      "pytorch-forecasting", pytorch_forecasting.__version__, "lightly", lightly.__version__)
PY
