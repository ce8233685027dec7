"""Multistreamable: an object whose tensors can be marked as used by another CUDA stream.

A train pipeline moves a batch, a module's input and its context to the device on a side stream; the
tensors they hold must be recorded on the stream that uses them next (``Tensor.record_stream``) so that
the caching allocator does not reuse their memory early. Contexts and inputs of sharded modules
implement this interface (torchrec's ``torchrec.streamable.Multistreamable``).
"""

from __future__ import annotations

import abc

import torch


class Multistreamable(abc.ABC):
    """An object holding tensors; ``record_stream(stream)`` marks each as used by ``stream``."""

    @abc.abstractmethod
    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor of this object as used by ``stream`` (see ``torch.Tensor.record_stream``)."""


__all__ = ["Multistreamable"]
