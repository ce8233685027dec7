"""Asynchronous exchange primitives of the comm ops, with codecs, and their cross-rank size check.

Three primitives move flat chunks: ``all_to_all`` (chunk ``r`` to rank ``r``), ``reduce_scatter``
(rank ``r`` gets the sum of every rank's chunk ``r``) and ``all_gather`` (every rank gets every rank's
chunk). Each encodes its chunks with the codec (if any), starts one collective with ``async_op=True``
and returns a ``Pending`` whose ``wait()`` completes the collective and decodes what arrived.

Data travels as bytes (``uint8``): a byte exchange has no dtype for a backend to reject (gloo has no
float8, older releases no bfloat16), and it lets the codec's wire dtype differ from the data's.
Only a reduce-scatter that sums on the wire sends a real dtype.

``checked_plan`` builds an op's plan and, with validation on, exchanges every rank's verdict and
``Layout`` (sizes sent to and expected from every rank, in one fixed-size all-gather of ints), so
that bad arguments on one rank or a disagreement between ranks is the same ``ValueError`` on every
rank before any data moves.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import (
    gather_objects,
    group_rank,
    group_size,
    reduce_scatter_flat,
)
from shardkit.distributed.codecs import QuantizedCommCodec, QuantizedCommCodecs
from shardkit.distributed.comm_ops import in_place, scratch
from shardkit.distributed.comm_ops.pending import Pending
from shardkit.distributed.direct_collectives import all_to_all_single
from shardkit.distributed.gather_blocks import all_gather_into
from shardkit.distributed.validation import validation_enabled

ProcessGroup = dist.ProcessGroup
T = TypeVar("T")
U = TypeVar("U")

# dtypes a backend other than gloo sums on the wire (gloo never does: see _sums_on_wire)
_WIRE_SUMS = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
        torch.float16,
        torch.bfloat16,
    }
)


def world_of(group: Optional[ProcessGroup]) -> int:
    """Size of ``group``; ``ValueError`` if this process is not a member (torch answers -1)."""
    size = group_size(group)
    if size < 1:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the given process group")
    return size


# --------------------------------------------------------------------------------------------------
# encoding


def _wire_dtype(codec: Optional[QuantizedCommCodec], dtype: torch.dtype) -> torch.dtype:
    return dtype if codec is None else codec.quantized_dtype


def _wire_numel(numel: int, codec: Optional[QuantizedCommCodec]) -> int:
    return numel if codec is None else codec.calc_quantized_size(numel)


def _encode(chunk: torch.Tensor, codec: Optional[QuantizedCommCodec]) -> torch.Tensor:
    flat = chunk.reshape(-1)
    wire = flat if codec is None else codec.encode(flat)
    return wire.reshape(-1).contiguous()


def _decode(wire: torch.Tensor, codec: Optional[QuantizedCommCodec], dtype: torch.dtype) -> torch.Tensor:
    return (wire if codec is None else codec.decode(wire)).to(dtype)


def _bytes(wire: torch.Tensor) -> torch.Tensor:
    return wire.view(torch.uint8)


def _from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # every piece starts at a multiple of the element size, so the view is aligned
    return raw.view(dtype)


def _pack(chunks: Sequence[torch.Tensor], dtype: torch.dtype, alias_ok: bool) -> tuple:
    """The chunks back to back as one byte buffer, and each chunk's byte count.

    Chunks that tile one contiguous tensor in order (rows split off a ``[B, D]`` output) are sent from
    that tensor without a copy when ``alias_ok`` (the buffer is only read); otherwise every chunk is
    copied once into a new buffer (column blocks of a gradient, say), never twice.
    """
    chunks = [chunk.to(dtype) for chunk in chunks]
    item = torch.empty(0, dtype=dtype).element_size()
    sizes = [chunk.numel() * item for chunk in chunks]
    flat = _back_to_back(chunks) if alias_ok else None
    if flat is None:
        flat = scratch.empty((sum(sizes) // item,), dtype, chunks[0].device if chunks else None)
        start = 0
        for chunk in chunks:
            flat[start : start + chunk.numel()].view(chunk.shape).copy_(chunk)
            start += chunk.numel()
    return _bytes(flat), sizes


def join(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The flat concatenation of ``pieces``: a view when they lie back to back in one buffer (the pieces
    of one receive buffer), else a copy."""
    pieces = [piece.reshape(-1) for piece in pieces]
    flat = _back_to_back(pieces)
    return torch.cat(pieces) if flat is None else flat


def _pack_padded(wires: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """The flat wires back to back, each zero-padded to ``width`` elements: the buffer they already
    lie in when they tile it with no padding (rows split off one tensor: sent without a copy, read
    only), else one copy of each into a new buffer."""
    if all(wire.numel() == width for wire in wires):
        flat = _back_to_back(wires)
        if flat is not None:
            return flat
    send = wires[0].new_zeros(width * len(wires))
    for i, wire in enumerate(wires):
        send[i * width : i * width + wire.numel()].copy_(wire)
    return send


def _back_to_back(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One flat view over ``tensors`` (one dtype) when they are contiguous and lie back to back, in
    order, in one storage; None otherwise (or when there are none)."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for tensor in tensors:
        if (
            not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage
            or tensor.data_ptr() != end
        ):
            return None
        end += tensor.numel() * tensor.element_size()
    total = sum(tensor.numel() for tensor in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,))


def _pad_to(flat: torch.Tensor, numel: int) -> torch.Tensor:
    return torch.cat([flat, flat.new_zeros(numel - flat.numel())])


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 or wider for floating and complex data, int64 for integers and bool."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.promote_types(dtype, torch.float32)
    return torch.int64


def _sums_on_wire(
    codec: Optional[QuantizedCommCodec], dtype: torch.dtype, device: torch.device, group
) -> bool:
    """Whether a reduce-scatter sums on the wire (the backend's own reduce-scatter).

    Not on gloo: its ``reduce_scatter_tensor`` took 1.5-2x the time of an all-to-all and a local sum
    (2 CPU ranks, [4096, 512] fp32, same values), and it cannot sum fp16 / bf16 at all.
    """
    if codec is not None and not getattr(codec, "sums_on_wire", False):
        return False
    backend = str(dist.get_backend(group))
    # a group may carry one backend per device type, e.g. "cpu:gloo,cuda:nccl"
    if backend == "gloo" or f"{device.type}:gloo" in backend:
        return False
    return _wire_dtype(codec, dtype) in _WIRE_SUMS


# --------------------------------------------------------------------------------------------------
# primitives


def all_to_all(
    chunks: Sequence[torch.Tensor],
    recv_numels: Sequence[int],
    dtype: torch.dtype,
    codec: Optional[QuantizedCommCodec],
    group: Optional[ProcessGroup],
    decode_to: Optional[torch.dtype] = None,
) -> Pending[list[torch.Tensor]]:
    """Send ``chunks[r]`` (``dtype``, any shape, sent flat) to rank ``r``, get ``recv_numels[s]`` from ``s``.

    ``wait()`` gives one flat tensor per source rank, of ``decode_to`` (default ``dtype``); views of
    one receive buffer (``uint8``, from ``comm_ops.scratch``: reused once nothing holds it) when no
    codec and no cast is involved.
    """
    wire_dtype = _wire_dtype(codec, dtype)
    item = torch.empty(0, dtype=wire_dtype).element_size()
    world = world_of(group)
    if codec is None:
        send, send_bytes = _pack(chunks, dtype, alias_ok=world > 1)
    else:
        sends = [_bytes(_encode(chunk, codec)) for chunk in chunks]
        send, send_bytes = torch.cat(sends), [chunk.numel() for chunk in sends]
    recv_bytes = [_wire_numel(n, codec) * item for n in recv_numels]
    if world == 1:
        recv, work = send, None
    else:
        recv = scratch.new_empty(send, sum(recv_bytes))
        work = all_to_all_single(recv, send, recv_bytes, send_bytes, group)
    received = recv

    def finish() -> list[torch.Tensor]:
        pieces = received.split(recv_bytes)
        return [_decode(_from_bytes(piece, wire_dtype), codec, decode_to or dtype) for piece in pieces]

    return Pending(work, finish)


def all_to_all_flat(
    flat: torch.Tensor,
    send_numels: Sequence[int],
    recv_numels: Sequence[int],
    group: Optional[ProcessGroup],
    world: int,
) -> Pending[torch.Tensor]:
    """``all_to_all`` without a codec for chunks already back to back in one contiguous tensor: the
    first ``send_numels[0]`` elements of ``flat`` to rank 0, the next ``send_numels[1]`` to rank 1, ...

    ``wait()`` gives the received ``[sum(recv_numels)]`` tensor of ``flat``'s dtype (source ranks in
    order; split it by ``recv_numels``). ``world`` is the group's size (the caller
    knows it). Sent as bytes like ``all_to_all``, without a copy; with one rank the received tensor is
    ``flat``. The receive buffer comes from ``comm_ops.scratch``.
    """
    if world == 1:
        return Pending(None, lambda: flat)
    item = flat.element_size()
    recv = scratch.new_empty(flat, sum(recv_numels))
    work = all_to_all_single(
        recv.view(torch.uint8),
        flat.view(torch.uint8),
        [n * item for n in recv_numels],
        [n * item for n in send_numels],
        group,
    )
    return Pending(work, lambda: recv)


def reduce_scatter(
    chunks: Sequence[torch.Tensor],
    dtype: torch.dtype,
    codec: Optional[QuantizedCommCodec],
    group: Optional[ProcessGroup],
) -> Pending[torch.Tensor]:
    """Rank ``r`` receives the sum over ranks of each rank's ``chunks[r]`` (flat, same numel on every rank).

    Summed on the wire (one padded reduce-scatter) when the backend sums the wire dtype exactly and
    the codec allows it; otherwise each rank receives the others' chunks by all-to-all (the same
    volume as a ring reduce-scatter) and sums them decoded, in float32 (float64 for float64 data).
    """
    rank, world = group_rank(group), world_of(group)
    own = chunks[rank].numel()
    device = chunks[rank].device
    if world > 1 and _sums_on_wire(codec, dtype, device, group):
        wires = [_encode(chunk, codec) for chunk in chunks]
        width = max(wire.numel() for wire in wires)
        send = _pack_padded(wires, width)
        out = send.new_empty(width)
        work = reduce_scatter_flat(out, send, group=group, async_op=True)
        return Pending(work, lambda: _decode(out[: _wire_numel(own, codec)], codec, dtype))
    accumulate = _accumulate_dtype(dtype)
    if world == 2 and codec is None and accumulate == dtype and all(c.dtype == dtype for c in chunks):
        summed = in_place.reduce_scatter_pair(chunks, dtype, rank, group)
        if summed is not None:  # through shared memory, the peer's term read in place
            return summed
    # the pieces are views of the receive buffer when no codec or cast is involved: no stacking
    # copy; the sum is a new tensor, so the buffer is scratch
    return all_to_all_consumed(
        chunks,
        [own] * world,
        dtype,
        codec,
        group,
        lambda pieces: _sum_pieces(pieces, own).to(dtype),
        decode_to=accumulate,
    )


def all_to_all_consumed(
    chunks: Sequence[torch.Tensor],
    recv_numels: Sequence[int],
    dtype: torch.dtype,
    codec: Optional[QuantizedCommCodec],
    group: Optional[ProcessGroup],
    consume: Callable[[list[torch.Tensor]], U],
    decode_to: Optional[torch.dtype] = None,
) -> Pending[U]:
    """``all_to_all(...).then(consume)`` for a ``consume`` that copies what it keeps of the pieces
    into new tensors (a sum, a concatenation): once ``consume`` has run and the ``Pending`` is
    dropped nothing holds the receive buffer, which ``comm_ops.scratch`` then hands to the next call
    of its size (a fresh buffer of tens of MiB is pages the receiving thread faults in, one by one).
    """
    return all_to_all(chunks, recv_numels, dtype, codec, group, decode_to=decode_to).then(consume)


def all_to_all_flat_consumed(
    flat: torch.Tensor,
    send_numels: Sequence[int],
    recv_numels: Sequence[int],
    group: Optional[ProcessGroup],
    world: int,
    consume: Callable[[Sequence[torch.Tensor]], U],
) -> Pending[U]:
    """``all_to_all_flat`` whose received pieces (``recv_numels``, source ranks in order) go to
    ``consume``, which copies what it keeps (the receive buffer is then free, as in
    :func:`all_to_all_consumed`)."""
    # split_with_sizes: Tensor.split's Python wrapper costs more than the split itself here
    received = all_to_all_flat(flat, send_numels, recv_numels, group, world)
    return received.then(lambda recv: consume(recv.split_with_sizes(recv_numels)))


def _sum_pieces(pieces: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """The elementwise sum of the ranks' received ``[numel]`` pieces.

    Two pieces: one add, the same values as ``sum(dim=0)`` of the two stacked (a sum of two terms is
    one rounded addition, whatever the order; only a zero's sign may differ, +0 where both are -0
    in the reduction) at about 2.5x less time than the reduction kernel (2 x [256, 16384] fp32 on
    one core, thread CPU: 2.6 ms against 6.5 ms). More pieces: the reduction over the stacked pieces,
    whose association (it is not left to right from 5 pieces on) this keeps.
    """
    if len(pieces) == 2:
        if pieces[0].numel() * pieces[0].element_size() < scratch.MIN_BYTES:
            return torch.add(pieces[0], pieces[1])  # out= costs ~5 us more, which small steps notice
        return torch.add(pieces[0], pieces[1], out=scratch.new_empty(pieces[0], *pieces[0].shape))
    return join(pieces).view(len(pieces), numel).sum(dim=0)


def all_gather(
    chunk: torch.Tensor,
    numels: Sequence[int],
    dtype: torch.dtype,
    codec: Optional[QuantizedCommCodec],
    group: Optional[ProcessGroup],
) -> Pending[list[torch.Tensor]]:
    """Every rank receives every rank's ``chunk`` (flat; rank ``r``'s has ``numels[r]`` elements).

    One all-gather of byte buffers padded to the largest chunk; ``wait()`` gives one flat tensor of
    ``dtype`` per rank.
    """
    if codec is None and len(numels) > 1 and chunk.dtype == dtype:
        gathered = in_place.all_gather_shared(chunk, numels, dtype, group_rank(group), group)
        if gathered is not None:  # through shared memory, this rank's chunk written once
            return gathered
    wire_dtype = _wire_dtype(codec, dtype)
    item = torch.empty(0, dtype=wire_dtype).element_size()
    wire_bytes = [_wire_numel(n, codec) * item for n in numels]
    width = max(wire_bytes)
    world = len(numels)
    wire = _bytes(_encode(chunk, codec))
    # the send buffer is only read: without padding, send the chunk itself (world 1 returns a copy)
    send = wire if wire.numel() == width and world > 1 else _pad_to(wire, width)
    if world == 1:
        out, work = send, None
    else:
        out = scratch.new_empty(send, world * width)
        # point to point on gloo for large blocks (gather_blocks: gloo's all-gather faults in and
        # copies out of a buffer of its own)
        work = all_gather_into(out, send, group=group, async_op=True)

    def finish() -> list[torch.Tensor]:
        pieces = [out[r * width : r * width + wire_bytes[r]] for r in range(world)]
        return [_decode(_from_bytes(piece, wire_dtype), codec, dtype) for piece in pieces]

    return Pending(work, finish)


# --------------------------------------------------------------------------------------------------
# cross-rank check


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one rank sends to and expects from every rank, in elements of the op's dtype.

    ``agree``: further values that must be equal on every rank (dtype, codecs, shapes), by name.
    """

    send: tuple[int, ...]
    recv: tuple[int, ...]
    agree: tuple[tuple[str, object], ...] = ()


def codec_key(codec: Optional[QuantizedCommCodec]) -> object:
    """A picklable description of a codec that equal codecs share (wire dtype and size of 1000 values)."""
    if codec is None:
        return None
    return (type(codec).__qualname__, str(codec.quantized_dtype), codec.calc_quantized_size(1000))


def check_local(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` (argument checks that need no communication)."""
    if not condition:
        raise ValueError(message)


def forward_codec(codecs: Optional[QuantizedCommCodecs]) -> Optional[QuantizedCommCodec]:
    """The codec of the forward pass (None: send the data as it is)."""
    return None if codecs is None else codecs.forward


def backward_codec(codecs: Optional[QuantizedCommCodecs]) -> Optional[QuantizedCommCodec]:
    """The codec of the gradients (None: send them as they are)."""
    return None if codecs is None else codecs.backward


def check_sizes(name: str, sizes: Sequence[int], world: int, rank: int) -> list[int]:
    """``sizes`` as a list of ints, checked to have one non-negative entry per rank."""
    sizes = [int(size) for size in sizes]
    # the messages are formatted only on failure: this runs on every step's output dist
    if len(sizes) != world:
        raise ValueError(
            f"{name} has {len(sizes)} entries {sizes} on rank {rank}, but the group has {world} ranks"
        )
    if min(sizes, default=0) < 0:
        raise ValueError(f"{name} {sizes} on rank {rank} has a negative entry")
    return sizes


def agree_values(dtype: torch.dtype, codecs: Optional[QuantizedCommCodecs], *extra) -> tuple:
    """``Layout.agree`` entries: the dtype, both codecs, and ``extra`` ``(name, value)`` pairs."""
    codec_keys = (codec_key(forward_codec(codecs)), codec_key(backward_codec(codecs)))
    return (("dtype", str(dtype)), ("codecs", codec_keys), *extra)


P = TypeVar("P")


def checked_plan(
    what: str, group: Optional[ProcessGroup], build: Callable[[], P], layout: Callable[[P], Layout]
) -> P:
    """``build()``, checked against the other ranks' when validation is on and the group has >1 rank.

    Every rank sends its verdict (failed or not, a fingerprint of its ``agree`` values, its sizes) in
    one fixed-size int all-gather; when that shows a problem, the verdicts themselves (the error
    ``build`` raised, or the ``layout``) follow in an object all-gather, and every rank raises the
    same ``ValueError`` when any rank's arguments are invalid, when ranks disagree on an ``agree``
    value, or when a rank sends another a different number of elements than that rank expects. With
    validation off, local errors still raise (on that rank).
    """
    world = world_of(group)
    try:
        plan, error = build(), None
    except (ValueError, IndexError, TypeError) as err:
        plan, error = None, err
    if world > 1 and validation_enabled():
        mine = None if plan is None else layout(plan)
        # the verdicts as one fixed-size int all-gather (one collective, no pickling); the objects
        # (messages, agree values) travel only when it shows a problem, which every rank sees alike
        rows = _verdict_rows(mine, world, group)
        if not _consistent(rows, world):
            verdict = f"{type(error).__name__}: {error}" if error is not None else None
            _raise_on_disagreement(what, gather_objects((verdict, mine), group), error)
    if error is not None:
        raise error
    return plan


def _verdict_rows(layout: Optional[Layout], world: int, group: Optional[ProcessGroup]) -> list:
    """Every rank's ``[failed, fingerprint of agree, send[0..W), recv[0..W)]`` (int64, all-gathered)."""
    if layout is None or len(layout.send) != world or len(layout.recv) != world:
        row = [1] + [0] * (1 + 2 * world)
    else:
        row = [0, _fingerprint(layout.agree), *layout.send, *layout.recv]
    device = torch.device(dist.distributed_c10d._get_object_coll_device(group))  # gather_objects' device
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    out = torch.empty(world * len(row), dtype=torch.int64, device=device)
    # through shared memory on one host (gather_blocks): a gloo all-gather's latency was ~0.15 ms a call
    all_gather_into(out, torch.tensor(row, dtype=torch.int64, device=device), group=group)
    return out.view(world, len(row)).tolist()


def _consistent(rows: list, world: int) -> bool:
    """No rank failed, all agree on the ``agree`` values, and each rank sends each what it expects."""
    if any(row[0] for row in rows) or any(row[1] != rows[0][1] for row in rows):
        return False
    return all(
        rows[src][2 + dst] == rows[dst][2 + world + src] for src in range(world) for dst in range(world)
    )


def _fingerprint(obj: object) -> int:
    """A 56-bit hash of ``repr(obj)``, the same in every process (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=7).digest(), "little")


def _raise_on_disagreement(what: str, views: list, error: Optional[Exception]) -> None:
    failed = [f"rank {rank}: {verdict}" for rank, (verdict, _) in enumerate(views) if verdict]
    if failed:
        raise ValueError(f"{what}: invalid arguments on {'; '.join(failed)}") from error
    layouts: list[Layout] = [layout for _, layout in views]
    for name, _ in layouts[0].agree:
        values = [dict(layout.agree).get(name) for layout in layouts]
        if any(value != values[0] for value in values[1:]):
            per_rank = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            raise ValueError(f"{what}: ranks disagree on the {name}: {per_rank}")
    world = len(layouts)
    bad = [
        f"rank {src} sends {layouts[src].send[dst]} to rank {dst}, which expects {layouts[dst].recv[src]}"
        for src in range(world)
        for dst in range(world)
        if layouts[src].send[dst] != layouts[dst].recv[src]
    ]
    if bad:
        raise ValueError(f"{what}: ranks disagree on the numbers of elements they exchange: {'; '.join(bad)}")
