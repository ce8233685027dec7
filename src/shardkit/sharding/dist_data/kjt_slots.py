"""The KJT all-to-all's tensors sent with its header: one collective per exchange at small batches.

Why: the exchange needs two collectives when the receivers cannot size their buffers before the
header has told them the sizes (phase one: the header; phase two: the tensors). At small batches a
collective's fixed cost, not its bytes, is what it costs (gloo, 2 CPU ranks: tens to hundreds of us
of CPU per all-to-all of a few KiB, the worker threads' included), and the DLRM step at batch 32 made
four collectives, two of them this exchange's.

How: every rank sends every rank one *slot* of the same size, ``len(HEADER) * 8 + capacity`` bytes:
the header row, then, when they fit in ``capacity`` bytes, the bytes of the tensors that go to that
rank (lengths, values, weights, per-key batch sizes: the *payload*), then zeros. The receiver reads
the headers (the one host sync, as before) and finds each source's payload in its slot. A payload
that does not fit travels in a second all-to-all (exact sizes, from the headers), which every rank
enters when any pair's payload did not fit: each header carries its sender's largest payload
(``need``), and every rank receives every sender's header, so every rank reaches the same verdict.

The capacity must be the same on every rank (gloo aborts the process on an all-to-all whose sizes do
not match). It is held per exchange site (:class:`SlotCapacity`, one per sharding), starts at 0 (the
slot is the bare header: the two-phase exchange), and changes only where a second all-to-all starts,
to ``need * 5 / 4`` (rounded up) of that exchange's largest need, which every rank knows. A second
all-to-all is a collective, which every rank makes at the same place of its sequence of
collectives, so every later exchange of the site starts with the same capacity on every rank,
whatever each rank did in between. Payloads above :data:`LIMIT` are not inlined (capacity 0 again):
at large batches the padding would cost more than the collective it saves.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.comm_ops import scratch
from shardkit.distributed.direct_collectives import all_to_all_single

# the largest slot payload (bytes): a rank pair's payload above this always goes by a second
# all-to-all (at batch 32 x 26 features the largest payload is ~10 KiB)
LIMIT = 256 << 10


class SlotCapacity:
    """The payload capacity (bytes, a multiple of 8) of one exchange site's slots: the same on every
    rank as long as every rank calls :meth:`refit` where it starts a second all-to-all (see above)."""

    def __init__(self) -> None:
        self.capacity = 0
        self._zeros: Dict[torch.device, torch.Tensor] = {}

    def refit(self, need: int) -> None:
        """A second all-to-all starts because some payload exceeded the capacity; ``need`` is the
        exchange's largest payload (the same number on every rank)."""
        self.capacity = 0 if need > LIMIT else (need + need // 4 + 64 + 7) // 8 * 8

    def zeros(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` zero bytes on ``device`` (a view of one buffer, kept between steps) to fill a slot."""
        zeros = self._zeros.get(device)
        if zeros is None or zeros.numel() < nbytes:
            zeros = self._zeros[device] = torch.zeros(
                max(nbytes, self.capacity), dtype=torch.uint8, device=device
            )
        return zeros[:nbytes]


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor's bytes (contiguous() keeps a one-element expanded tensor at stride 0, which cannot
    be viewed as bytes)."""
    flat = tensor.clone(memory_format=torch.contiguous_format) if tensor.stride() != (1,) else tensor
    return flat.view(torch.uint8)


def payload_bytes(tensors: Dict[str, torch.Tensor], counts: Dict[str, List[int]], world: int) -> List[int]:
    """Bytes of each rank's payload: ``counts[label][r]`` elements of each tensor go to rank ``r``."""
    items = {label: tensor.element_size() for label, tensor in tensors.items()}
    return [sum(counts[label][r] * items[label] for label in tensors) for r in range(world)]


def _payload_pieces(
    tensors: Dict[str, torch.Tensor], counts: Dict[str, List[int]], ranks: List[int]
) -> List[torch.Tensor]:
    """Byte views of the payloads of ``ranks`` (in that order), each label after the other."""
    as_bytes = {label: flat_bytes(tensor) for label, tensor in tensors.items()}
    items = {label: tensor.element_size() for label, tensor in tensors.items()}
    starts = {label: [0, *accumulate(counts[label])] for label in tensors}
    return [
        as_bytes[label][starts[label][r] * items[label] : starts[label][r + 1] * items[label]]
        for r in ranks
        for label in tensors
    ]


def pack_slots(
    headers: torch.Tensor,
    tensors: Dict[str, torch.Tensor],
    counts: Dict[str, List[int]],
    payload: List[int],
    capacity: int,
    slots: SlotCapacity,
) -> torch.Tensor:
    """The bytes this rank sends: ``[world * (header bytes + capacity)]`` uint8, slot ``r`` for rank ``r``.

    ``headers``: ``[world, len(HEADER)]`` int64 rows; ``payload[r]``: bytes of rank ``r``'s payload
    (``payload_bytes``), inlined when at most ``capacity``; ``tensors`` may be empty (a failed rank).
    """
    header_bytes = headers.view(torch.uint8)
    if capacity == 0:
        return header_bytes.view(-1)
    inline = [r for r, size in enumerate(payload) if tensors and size <= capacity]
    payloads = iter(_payload_pieces(tensors, counts, inline))
    pieces: List[torch.Tensor] = []
    for r, size in enumerate(payload):
        pieces.append(header_bytes[r])
        pad = capacity
        if inline and r in inline:
            pieces.extend(next(payloads) for _ in tensors)
            pad -= size
        if pad:
            pieces.append(slots.zeros(pad, headers.device))
    return torch.cat(pieces)


class SlotAllToAll:
    """The tensors of one exchange, found in the received slots and, for the payloads that did not fit,
    received by a second all-to-all (started here, when ``spill``: on every rank alike).

    ``tensors`` / ``send`` / ``recv``: label -> this rank's tensor, elements sent to each rank,
    elements received from each rank. ``received``: the first all-to-all's output (``[world *
    slot_bytes]`` uint8, complete; None: no slots, everything by the second all-to-all), ``header_bytes``
    at the start of each slot. ``wait()`` -> label ->
    ``[sum(recv[label])]`` tensor of that label's dtype, the source ranks' pieces in rank order (a
    fresh tensor per label, so that its bytes are aligned for the dtype).
    """

    def __init__(
        self,
        tensors: Dict[str, torch.Tensor],
        send: Dict[str, List[int]],
        recv: Dict[str, List[int]],
        pg,
        received: Optional[torch.Tensor],
        slot_bytes: int,
        header_bytes: int,
        capacity: int,
        spill: bool,
    ) -> None:
        self._tensors, self._recv = tensors, recv
        self._received, self._slot_bytes, self._header_bytes = received, slot_bytes, header_bytes
        world = len(next(iter(recv.values())))
        self._items = {label: tensor.element_size() for label, tensor in tensors.items()}
        self._from = payload_bytes(tensors, recv, world)
        self._capacity = capacity
        self._work: Optional[dist.Work] = None
        if not spill:
            return
        to = payload_bytes(tensors, send, world)
        sent = [r for r in range(world) if to[r] > capacity]
        pieces = _payload_pieces(tensors, send, sent)
        send_bytes = [size if size > capacity else 0 for size in to]
        recv_bytes = [size if size > capacity else 0 for size in self._from]
        device = next(iter(tensors.values())).device
        # MiBs of ids at large batches: buffers kept across steps (comm_ops.scratch), not fresh pages
        self._spilled = scratch.take(sum(recv_bytes), device)
        out = scratch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
        self._work = all_to_all_single(self._spilled, out, recv_bytes, send_bytes, pg)

    def wait(self) -> Dict[str, torch.Tensor]:
        if self._work is not None:
            self._work.wait()
        labels = list(self._tensors)
        pieces: Dict[str, List[torch.Tensor]] = {label: [] for label in labels}
        spilled_at = 0
        for s, size in enumerate(self._from):
            if size > self._capacity or self._received is None:
                source, at = self._spilled, spilled_at
                spilled_at += size
            else:
                source, at = self._received, s * self._slot_bytes + self._header_bytes
            for label in labels:
                n = self._recv[label][s] * self._items[label]
                pieces[label].append(source[at : at + n])
                at += n
        return {label: scratch.cat(pieces[label]).view(self._tensors[label].dtype) for label in labels}


__all__ = ["LIMIT", "SlotAllToAll", "SlotCapacity", "flat_bytes", "pack_slots", "payload_bytes"]
