"""The suite's Lightning callbacks, one module each."""

from lightning_overflow.callbacks.auto_clip import AutoClip
from lightning_overflow.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_overflow.callbacks.loss_spike_detector import LossSpikeDetector
from lightning_overflow.callbacks.lr_backoff import LRBackoff
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector
from lightning_overflow.callbacks.rollback import Rollback

__all__ = ["AutoClip", "GradNormMonitor", "LRBackoff", "LossSpikeDetector", "NonFiniteDetector", "Rollback"]
