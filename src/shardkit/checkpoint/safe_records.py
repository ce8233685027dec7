"""Reading a checkpoint's non-tensor records without running code from them.

DCP stores every value of a state dict that is not a tensor (a learning rate, a step count, an
optimizer's hyper-parameters) as a ``BytesStorageMetadata`` record: a ``torch.save`` of the value.
torch 2.13's ``DefaultLoadPlanner.load_bytes`` (and so every planner derived from it) reads such a
record with ``torch.load(weights_only=False)``, i.e. a full ``pickle.load`` that runs whatever
callable the record names: a crafted record executes code on the rank that reads it, whatever the
metadata looks like.

:class:`SafeRecordsPlanner` wraps the caller's planner for the storage reader's ``read_data``: it
loads each record with ``torch.load(weights_only=True)`` (torch's allow-list of plain values,
containers and tensors, which a caller cannot switch off with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
when ``weights_only`` is passed), refuses anything else naming the record, and hands the planner a
fresh ``torch.save`` of the loaded value: the planner's own unpickling then only sees what this
module wrote. Works with any planner (it only replaces ``load_bytes``).
"""

from __future__ import annotations

import io
import pickle
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from shardkit.checkpoint.metadata_bounds import UnsafeMetadataError


def load_record(value: io.BytesIO, fqn: str, where: str) -> Any:
    """The value of the non-tensor record ``fqn`` (read from checkpoint ``where``), unpickled with
    torch's weights-only allow-list; ``UnsafeMetadataError`` naming the record otherwise."""
    try:
        with warnings.catch_warnings():
            # a pickle protocol other than torch's own is refused below if it matters; no warning
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeMetadataError(
            f"{where}: refusing to load the record {fqn!r}: it is not a plain value ({_why(str(err))}); "
            "the checkpoint is corrupted or crafted"
        ) from None
    except Exception as err:  # noqa: BLE001 - any other failure is a damaged record; say which
        raise UnsafeMetadataError(
            f"{where}: the record {fqn!r} is not readable ({type(err).__name__}: {str(err)[:200]})"
        ) from None


def _why(message: str) -> str:
    """The part of torch's weights-only error that says what was refused (it also advises loading
    with ``weights_only=False``, which is the one thing not to do here)."""
    for marker in ("WeightsUnpickler error:", "from a trusted source."):
        if marker in message:
            message = message.split(marker, 1)[1]
            break
    message = message.split("Check the documentation", 1)[0]
    return " ".join(message.split())[:300] or "refused"


class SafeRecordsPlanner:
    """A proxy of ``planner`` whose ``load_bytes`` only passes on values :func:`load_record` accepts;
    every other attribute is the planner's own."""

    def __init__(self, planner: LoadPlanner, where: str) -> None:
        self._planner = planner
        self._where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_record(value, read_item.dest_index.fqn, self._where)
        clean = io.BytesIO()
        torch.save(loaded, clean)  # only allow-listed values: safe for any unpickler downstream
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


__all__ = ["SafeRecordsPlanner", "load_record"]
