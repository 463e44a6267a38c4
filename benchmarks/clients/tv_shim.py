"""Make PyPI's torchvision importable beside the CPU build of torch (the lightly lane needs it importable only).

PyPI's Linux torchvision wheels are CUDA builds: their compiled ops (``torchvision/_C.so``) link ``libc10_cuda.so``
and ``libtorch_cuda.so``, which the CPU torch wheel lacks, so the ops library fails to load. torchvision tolerates
that everywhere (``extension._has_ops()`` is False, ``_meta_registrations.register_meta`` checks it) except for two
unguarded ``@torch.library.register_fake("torchvision::nms")`` / ``("torchvision::qnms")`` decorators, which raise
``RuntimeError: operator torchvision::nms does not exist`` during ``import torchvision``.

We define those two operator schemas (no kernels) before the import. Everything pure-Python in torchvision then
works; calling ``torchvision.ops.nms`` (or any compiled op) still raises, and the lane never calls one: lightly only
imports ``torchvision.ops.roi_align`` / ``StochasticDepth`` and ``torchvision.models.vision_transformer`` at module
level, and SimCLR/SwaV with NTXentLoss/SwaVLoss run none of them.
"""

from __future__ import annotations

import torch

_LIB = None


def install() -> None:
    global _LIB
    if _LIB is not None:
        return
    try:
        import torchvision  # noqa: F401  (a CPU torchvision or a matching build: nothing to do)
        return
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
    import sys

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    _LIB = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            _LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined
    import torchvision  # noqa: F401,F811
