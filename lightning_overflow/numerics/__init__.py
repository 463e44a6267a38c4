"""Pure-torch numerics behind the callbacks, usable in a plain PyTorch loop (no Lightning import)."""

from lightning_overflow.numerics.agc import (
    agc_,
    agc_coefficients,
    agc_coefficients_and_norms,
    smallest_coefficient,
    unitwise_norms,
)
from lightning_overflow.numerics.clipping import (
    HostPercentile,
    HostZScore,
    clip_coefficient,
    clip_grad_norm_,
    host_clip_coefficient,
    scale_grads_,
)
from lightning_overflow.numerics.lr_scaling import (
    GROUP_LR_KEYS,
    SCHEDULER_LR_LISTS,
    scale_lr,
    scheduler_tree,
)
from lightning_overflow.numerics.norms import (
    FP32_MAX,
    NormReport,
    grad_norm_report,
    norm_status,
    refine_norms,
    tensor_norms,
    total_norm,
)
from lightning_overflow.numerics.running_stats import (
    HostRunningStats,
    ema_alpha,
)
from lightning_overflow.numerics.snapshots import (
    SnapshotError,
    clone_state,
    nonfinite_flag,
    nonfinite_indices,
    nonfinite_paths,
    restore_optimizer_,
    restore_state_,
    state_matches,
    state_nbytes,
    state_tensors,
    synchronize,
    take_snapshot,
)
from lightning_overflow.numerics.state import parameters_of

__all__ = [
    "FP32_MAX",
    "GROUP_LR_KEYS",
    "SCHEDULER_LR_LISTS",
    "HostPercentile",
    "HostRunningStats",
    "HostZScore",
    "NormReport",
    "SnapshotError",
    "agc_",
    "agc_coefficients",
    "agc_coefficients_and_norms",
    "clip_coefficient",
    "clip_grad_norm_",
    "clone_state",
    "ema_alpha",
    "grad_norm_report",
    "host_clip_coefficient",
    "nonfinite_flag",
    "nonfinite_indices",
    "nonfinite_paths",
    "norm_status",
    "parameters_of",
    "refine_norms",
    "restore_optimizer_",
    "restore_state_",
    "scale_grads_",
    "scale_lr",
    "scheduler_tree",
    "smallest_coefficient",
    "state_matches",
    "state_nbytes",
    "state_tensors",
    "synchronize",
    "take_snapshot",
    "tensor_norms",
    "total_norm",
    "unitwise_norms",
]
