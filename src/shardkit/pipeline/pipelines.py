"""Train pipelines: ``progress(dataloader_iter)`` runs one training step and keeps later batches moving.

- ``TrainPipelineBase``: the next batch is fetched and moved to the device before the current step.
- ``TrainPipelineSparseDist``: the sharded modules' input dists of batch i+1 start before the forward
  of batch i (sizes phase) and move on to the tensors phase right after it, so they run during batch
  i's forward, backward and optimizer step; batch i+1's forward then only waits for the tensors.
- ``PrefetchTrainPipelineSparseDist``: three batches in flight; batch i+1's input dist is completed
  during step i, so the forward of each batch finds its input already received.

Each batch moves through stages (``_Stage``); after every forward, each later batch in flight advances
one stage. The model's forward must take the batch and return ``(losses, output)``; ``progress`` runs
``losses.sum().backward()`` and the optimizer step when the model is training, and returns ``output``.
Every rank must draw the same number of batches: the input dists and the model's forward are
collectives. With validation on (the default; ``shardkit.distributed.set_validation``) the ranks
agree on every draw (one all-gather of a flag, a host sync), so data that ends on some ranks only is
a ``ValueError`` on every rank instead of a hang.

Once an iterator has ended, ``progress`` with it raises ``StopIteration`` without asking it again;
``progress`` with a new iterator (the next epoch) starts over.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import enum
from typing import Any, Deque, Generic, Iterator, List, Optional, Type, TypeVar

import torch
from torch import nn

from shardkit.distributed.agreement import group_size
from shardkit.distributed.gather_blocks import all_gather_into
from shardkit.distributed.validation import validation_enabled
from shardkit.model_parallel import get_unwrapped_module
from shardkit.pipeline.context import PrefetchTrainPipelineContext, TrainPipelineContext
from shardkit.pipeline.forwards import BaseForward, PipelinedForward, PrefetchPipelinedForward
from shardkit.pipeline.tracing import build_args, find_pipelineable_modules

In = TypeVar("In")
Out = TypeVar("Out")


def _every_rank_drew(drew: bool, device: torch.device) -> bool:
    """Whether this draw produced a batch; ``ValueError`` on every rank when only some ranks got one.

    The default group's ranks exchange a flag (skipped when validation is off or on a single rank).
    """
    if not validation_enabled():  # checked first: it costs less than asking the group's size
        return drew
    world = group_size(None)
    if world == 1:
        return drew
    flags = torch.empty(world, dtype=torch.int64, device=device)
    # through shared memory on one host (gather_blocks): every step makes this gather
    all_gather_into(flags, torch.tensor([int(drew)], dtype=torch.int64, device=device))
    flags = flags.tolist()
    if min(flags) != max(flags):
        ended = [rank for rank, flag in enumerate(flags) if not flag]
        raise ValueError(
            f"the data ended on ranks {ended} while the other ranks drew another batch: every rank "
            f"must draw the same number of batches"
        )
    return drew


def _to_device(batch: Any, device: torch.device) -> Any:
    """``batch.to(device, non_blocking=True)``; the batch type must provide ``to`` (tensors do)."""
    if not hasattr(batch, "to"):
        raise TypeError(
            f"a pipelined batch needs a to(device, non_blocking) method; got {type(batch).__name__}"
        )
    return batch.to(device, non_blocking=True)


class TrainPipeline(abc.ABC, Generic[In, Out]):
    """A training loop step by step: each ``progress`` trains on one batch and returns its output."""

    @abc.abstractmethod
    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Train on the next batch; raise ``StopIteration`` once every batch has been trained on."""


class _Trainer:
    """What every pipeline shares: the model, optimizer and device, and one training step."""

    def __init__(self, model: nn.Module, optimizer: Any, device: torch.device) -> None:
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)

    def _step(self, batch: Any) -> Any:
        """Forward on ``batch``; backward and optimizer step when training. Returns the output."""
        losses, output = self._model(batch)
        if self._model.training:
            torch.sum(losses).backward()
            self._optimizer.step()
        return output


class TrainPipelineBase(_Trainer, TrainPipeline[In, Out]):
    """Two stages: the next batch is fetched and copied to ``device`` before the current step runs."""

    def __init__(self, model: nn.Module, optimizer: Any, device: torch.device) -> None:
        super().__init__(model, optimizer, device)
        self._next: Optional[Any] = None
        self._ended: Optional[Iterator[In]] = None  # the iterator that raised StopIteration

    def _fetch(self, dataloader_iter: Iterator[In]) -> Optional[Any]:
        if dataloader_iter is self._ended:
            return None
        try:
            batch = next(dataloader_iter)
        except StopIteration:
            batch = None
        if not _every_rank_drew(batch is not None, self._device):
            self._ended = dataloader_iter
            return None
        return _to_device(batch, self._device)

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        batch = self._next if self._next is not None else self._fetch(dataloader_iter)
        if batch is None:
            raise StopIteration
        if self._model.training:
            self._optimizer.zero_grad()
        self._next = self._fetch(dataloader_iter)
        return self._step(batch)


class _Stage(enum.IntEnum):
    """How far a batch in flight has come."""

    LOADED = 0  # on the device
    SPLITS = 1  # every pipelined module's input dist started (first phase: sizes)
    TENSORS = 2  # sizes received, second phase (tensors) started
    READY = 3  # tensors received (prefetch pipeline only)


@dataclasses.dataclass
class _InFlight:
    batch: Any
    context: TrainPipelineContext
    stage: _Stage = _Stage.LOADED


class TrainPipelineSparseDist(_Trainer, TrainPipeline[In, Out]):
    """Overlaps the sharded modules' input dists of batch i+1 with the forward, backward and optimizer
    step of batch i.

    Args:
        model: the model (usually a ``DistributedModelParallel``); its forward takes the batch and
            returns ``(losses, output)``. It must be symbolically traceable (torch.fx) apart from the
            sharded modules and DDP.
        optimizer: stepped after each backward (e.g. a ``CombinedOptimizer``).
        device: where batches are copied (``batch.to(device, non_blocking=True)``).
        execute_all_batches: after the data ends, still train on the batches already in flight
            (True), or stop at once (False: those batches are dropped).
        apply_jit: not supported (raises ``ValueError`` if True).

    The sharded modules whose input is a function of the batch (attributes / items of it) are found
    at construction and their forward replaced by a pipelined forward (:attr:`pipelined_modules`);
    :meth:`detach` restores them. Other sharded modules run their ordinary forward.
    """

    _forward_stage = _Stage.TENSORS
    _context_type: Type[TrainPipelineContext] = TrainPipelineContext
    _forward_type: Type[BaseForward] = PipelinedForward

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
    ) -> None:
        if apply_jit:
            raise ValueError("apply_jit is not supported: shardkit pipelines run the model eagerly")
        super().__init__(model, optimizer, device)
        self._execute_all_batches = execute_all_batches
        self._in_flight: Deque[_InFlight] = collections.deque()
        self._ended: Optional[Iterator[In]] = None  # the iterator that raised StopIteration
        empty = self._context_type()
        self._forwards: List[BaseForward] = []
        for name, module, args in find_pipelineable_modules(get_unwrapped_module(model)):
            forward = self._forward_type(name, args, module, empty)
            module.forward = forward
            self._forwards.append(forward)

    @property
    def pipelined_modules(self) -> List[str]:
        """Paths of the sharded modules whose forward the pipeline replaced."""
        return [f.name for f in self._forwards]

    def detach(self) -> nn.Module:
        """Restore the pipelined modules' own forwards (and drop the batches in flight); returns the
        model, usable outside the pipeline again."""
        for forward in self._forwards:
            del forward.module.forward  # the instance attribute; the class's forward shows again
        self._forwards = []
        self._in_flight.clear()
        return self._model

    # ---- stages -------------------------------------------------------------------------------

    def _load(self, dataloader_iter: Iterator[In]) -> bool:
        """Fetch one batch into the pipeline; False once the data has ended."""
        if dataloader_iter is self._ended:
            return False
        try:
            batch = next(dataloader_iter)
        except StopIteration:
            batch = None
        if not _every_rank_drew(batch is not None, self._device):
            self._ended = dataloader_iter
            return False
        self._in_flight.append(_InFlight(_to_device(batch, self._device), self._context_type()))
        return True

    def _advance(self, item: _InFlight) -> None:
        """Move ``item`` one stage on."""
        ctx = item.context
        if item.stage is _Stage.LOADED:
            for forward in self._forwards:
                module_context = forward.module.create_context()
                args, kwargs = build_args(item.batch, forward.args)
                ctx.module_contexts[forward.name] = module_context
                ctx.input_dist_splits_requests[forward.name] = forward.module.input_dist(
                    module_context, *args, **kwargs
                )
        elif item.stage is _Stage.SPLITS:
            for name, request in ctx.input_dist_splits_requests.items():
                ctx.input_dist_tensors_requests[name] = request.wait()
            ctx.input_dist_splits_requests.clear()
        elif item.stage is _Stage.TENSORS:
            modules = {forward.name: forward.module for forward in self._forwards}
            for name, request in ctx.input_dist_tensors_requests.items():
                received = ctx.module_input_post_prefetch[name] = request.wait()
                ctx.module_contexts_post_prefetch[name] = ctx.module_contexts.pop(name)
                prefetch = getattr(modules[name], "prefetch", None)
                if prefetch is not None:  # offloaded tables load this batch's rows now, a step early
                    prefetch(received, None, ctx.module_contexts_post_prefetch[name])
            ctx.input_dist_tensors_requests.clear()
        item.stage = _Stage(item.stage + 1)

    def _fill(self, dataloader_iter: Iterator[In]) -> None:
        """Batch k of the pipeline (k = 0 is the next to train) at stage ``forward stage - k``."""
        depth = int(self._forward_stage) - 1  # batches in flight between two steps
        while len(self._in_flight) < depth and self._load(dataloader_iter):
            pass
        for k, item in enumerate(self._in_flight):
            while item.stage < self._forward_stage - k:
                self._advance(item)

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        self._fill(dataloader_iter)
        ended = dataloader_iter is self._ended
        if not self._in_flight or (ended and not self._execute_all_batches):
            self._in_flight.clear()
            raise StopIteration
        if self._model.training:
            self._optimizer.zero_grad()
        # the next batch enters the pipeline: its input dist starts now and runs during this step
        if self._load(dataloader_iter):
            self._advance(self._in_flight[-1])
        current = self._in_flight[0]
        for forward in self._forwards:
            forward.set_context(current.context)
        losses, output = self._model(current.batch)
        for item in list(self._in_flight)[1:]:
            self._advance(item)
        if self._model.training:
            torch.sum(losses).backward()
            self._optimizer.step()
        self._in_flight.popleft()
        return output


class PrefetchTrainPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """Three batches in flight: during step i, batch i+1's input dist completes (its input is received
    and kept in its context) and batch i+2's starts, so no forward waits for communication.

    When batch i+1's input has arrived (during step i, after its forward), each sharded module's
    ``prefetch`` loads the rows it will read into the caches of its ``fused_uvm_caching`` tables whose
    cache params set ``prefetch_pipeline`` (pinned until that forward: batch i's rows stay pinned too, so
    nothing in flight is evicted). Arguments as ``TrainPipelineSparseDist``.
    """

    _forward_stage = _Stage.READY
    _context_type = PrefetchTrainPipelineContext
    _forward_type = PrefetchPipelinedForward


__all__ = [
    "PrefetchTrainPipelineSparseDist",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
]
