"""``JaggedTensorAllToAll``: rows of a JaggedTensor redistributed over the ranks (torchrec's).

Rank r sends its rows in rank order (the first ``num_items_to_send[0]`` rows to rank 0, the next
``num_items_to_send[1]`` to rank 1, ...) and receives ``num_items_to_receive[s]`` rows from each rank
s, concatenated in rank order. Lengths travel first (the values' split sizes are their sums), then
values and weights, asynchronously; ``wait()`` returns the received JaggedTensor.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from shardkit.distributed.awaitable import Awaitable
from shardkit.sparse import JaggedTensor

Counts = Union[torch.Tensor, Sequence[int]]


def _host_ints(counts: Counts) -> List[int]:
    return [int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]


class JaggedTensorAllToAll(Awaitable[JaggedTensor]):
    """Redistribute ``jt``'s rows: ``num_items_to_send[r]`` rows to rank r, ``num_items_to_receive[s]``
    rows from rank s (both ``[world]``, known on every rank beforehand, usually from an all-to-all of
    the send counts). Values ``[N, *D]`` and weights travel with their rows.

    Raises ``ValueError`` on every rank if any rank's counts are inconsistent: a count list not of
    the world's size, send counts that do not cover the rows, or a rank expecting a number of rows
    that its sender does not send (one small all-to-all and all-reduce before the data moves).
    """

    def __init__(
        self,
        jt: JaggedTensor,
        num_items_to_send: Counts,
        num_items_to_receive: Counts,
        pg: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        send, receive = _host_ints(num_items_to_send), _host_ints(num_items_to_receive)
        lengths = jt.lengths()
        problem = None
        if len(send) != world or len(receive) != world:
            problem = f"{len(send)} send and {len(receive)} receive counts for {world} ranks"
        elif sum(send) != lengths.numel():
            problem = (
                f"send counts {send} sum to {sum(send)}, but the JaggedTensor has {lengths.numel()} rows"
            )
        _agree(problem, send if problem is None else [0] * world, receive, rank, world, pg)
        received_lengths = lengths.new_empty(sum(receive))
        dist.all_to_all_single(received_lengths, lengths, receive, send, group=pg)
        value_send = (
            [int(n) for n in torch.stack([s.sum() for s in lengths.split(send)]).tolist()] if send else []
        )
        value_receive = [int(s.sum()) for s in received_lengths.split(receive)]
        self._lengths = received_lengths
        self._values, self._values_work = _start(
            jt.values()[: sum(value_send)], value_send, value_receive, pg
        )
        weights = jt.weights_or_none()
        self._weights, self._weights_work = (
            (None, None)
            if weights is None
            else _start(weights[: sum(value_send)], value_send, value_receive, pg)
        )

    def _wait_impl(self) -> JaggedTensor:
        for work in (self._values_work, self._weights_work):
            if work is not None:
                work.wait()
        return JaggedTensor(self._values, self._weights, lengths=self._lengths, validate=False)


def _start(tensor: torch.Tensor, send: List[int], receive: List[int], pg):
    out = tensor.new_empty(sum(receive), *tensor.shape[1:])
    work = dist.all_to_all_single(out, tensor.contiguous(), receive, send, group=pg, async_op=True)
    return out, work


def _agree(problem: Optional[str], send: List[int], receive: List[int], rank: int, world: int, pg) -> None:
    """Every rank raises if any rank has bad counts or expects other counts than its senders send."""
    sent_to_me = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(sent_to_me, torch.tensor(send, dtype=torch.int64), group=pg)
    if problem is None and sent_to_me.tolist() != receive:
        problem = f"expects {receive} rows from the ranks, which send it {sent_to_me.tolist()}"
    failed = torch.tensor([0 if problem is None else 1], dtype=torch.int64)
    dist.all_reduce(failed, group=pg)
    if problem is not None:
        raise ValueError(f"JaggedTensorAllToAll: rank {rank} {problem}")
    if int(failed):
        raise ValueError(f"JaggedTensorAllToAll: {int(failed)} other rank(s) found their counts inconsistent")
