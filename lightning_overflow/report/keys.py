"""Which logged series each panel draws: the suite's own keys by name, the user's losses chosen deliberately.

A loss is never found by a substring match on ``"loss"``: the suite logs keys such as
``overflow/headroom_loss_decades`` that contain the word. The training loss is the first of :data:`LOSS_KEYS` the
LightningModule logged, else the one user key that reads as a training loss (``train_mse_loss``).
"""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = [
    "CLIP_KEY",
    "GRAD_NORM_KEY",
    "HEADROOM_KEY",
    "HEADROOM_PARTS",
    "LOSS_KEYS",
    "LR_SCALE_KEY",
    "SKIPPED_KEY",
    "SUITE_PREFIXES",
    "VAL_KEYS",
    "choose_loss_key",
    "choose_val_key",
    "headroom_part_key",
    "is_suite_key",
]

SUITE_PREFIXES = ("grad_norm/", "clip/", "overflow/")
GRAD_NORM_KEY = "grad_norm/total"
CLIP_KEY = "clip/threshold"
LR_SCALE_KEY = "overflow/lr_scale"
SKIPPED_KEY = "overflow/skipped_steps"
HEADROOM_KEY = "overflow/headroom_decades"
# Each part of the headroom under its current name first, then under the name of version 0.1 (a path below
# HEADROOM_KEY, which file-based trackers cannot store beside HEADROOM_KEY itself).
HEADROOM_PARTS: dict[str, tuple[str, str]] = {
    part: (f"overflow/headroom_{part}_decades", f"overflow/headroom_decades/{part}")
    for part in ("loss", "grad", "activation")
}

# What LightningModules call their training loss, most specific first: a step value before an epoch mean.
LOSS_KEYS = (
    "train_loss", "train/loss", "loss", "train_loss_step", "train/loss_step", "loss_step", "training_loss",
    "training/loss", "train_loss_epoch", "train/loss_epoch", "loss_epoch",
)  # fmt: skip
VAL_KEYS = (
    "val_loss", "val/loss", "valid_loss", "valid/loss", "validation_loss", "validation/loss", "val_loss_epoch",
    "val/loss_epoch",
)  # fmt: skip

# A key is an evaluation metric when one of its path segments reads as one: "val_loss", "val/acc", and a library's
# own prefix before it (neuralforecast logs "ptl/val_loss").
_EVALUATION = re.compile(r"(^|/)(val|valid|validation|eval|test|predict)([_/]|$)", re.IGNORECASE)
_AFTER_FIT = re.compile(r"(^|/)(test|predict)([_/]|$)", re.IGNORECASE)


def is_suite_key(key: str) -> bool:
    """Whether ``key`` is one of lightning_overflow's own metrics (never a user's loss)."""
    return key.startswith(SUITE_PREFIXES) or "headroom" in key


def choose_loss_key(keys: Collection[str]) -> str | None:
    """The user's training loss among the logged ``keys``, or ``None`` when none reads as one.

    Example:
        >>> choose_loss_key(["overflow/headroom_decades/loss", "train/loss", "val/loss"])
        'train/loss'
        >>> choose_loss_key(["grad_norm/total", "overflow/headroom_loss_decades"]) is None
        True
        >>> choose_loss_key(["ptl/val_loss", "ptl/train_loss"])
        'ptl/train_loss'
        >>> choose_loss_key(["ptl/val_loss"]) is None
        True
    """
    user = [k for k in keys if not is_suite_key(k)]
    for name in LOSS_KEYS:
        if name in user:
            return name
    named = [k for k in user if "loss" in k.lower() and not _EVALUATION.search(k)]
    # A training loss spelled otherwise: prefer one that says "train", then a per-step value over an epoch mean.
    named.sort(key=lambda k: ("train" not in k.lower(), k.endswith("_epoch"), k))
    return named[0] if named else None


def choose_val_key(keys: Collection[str]) -> str | None:
    """The user's validation loss among the logged ``keys``, or ``None``.

    Example:
        >>> choose_val_key(["train_loss", "val/loss"])
        'val/loss'
        >>> choose_val_key(["train_loss", "ptl/val_loss", "ptl/test_loss"])  # neuralforecast's
        'ptl/val_loss'
    """
    user = [k for k in keys if not is_suite_key(k)]
    for name in VAL_KEYS:
        if name in user:
            return name
    # Only validation: a test or predict loss is measured after the fit, not during it.
    named = sorted(
        k for k in user
        if "loss" in k.lower() and _EVALUATION.search(k) and not _AFTER_FIT.search(k)
    )
    return named[0] if named else None


def headroom_part_key(keys: Collection[str], part: str) -> str | None:
    """The key under which the ``part`` (``"loss"``, ``"grad"``, ``"activation"``) of the headroom was logged."""
    return next((k for k in HEADROOM_PARTS[part] if k in keys), None)
