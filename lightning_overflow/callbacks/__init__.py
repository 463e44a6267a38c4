"""The suite's Lightning callbacks, one module each."""

from lightning_overflow.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector

__all__ = ["GradNormMonitor", "NonFiniteDetector"]
