"""Data that flows through a training step: the :class:`Batch` container."""

from megarl.data.batch import Batch

__all__ = ["Batch"]
