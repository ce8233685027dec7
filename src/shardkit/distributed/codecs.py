"""Quantized communication codecs: lower-precision encodings of the tensors a comm op sends.

A comm op (``shardkit.distributed.comm_ops``) with ``codecs=QuantizedCommCodecs(forward, backward)``
encodes what it sends in the forward pass with ``forward`` and the gradients it sends in the backward
pass with ``backward``, and decodes what it receives with the same codec. Each chunk sent to one rank
is encoded on its own (``encode`` takes a 1-D tensor), so a codec may add per-chunk data (scales).

Precisions and the error of one encode/decode round trip, per element ``x`` of a chunk whose largest
magnitude is ``amax`` (round to nearest):

| precision | wire dtype | relative error | absolute floor | range |
|---|---|---|---|---|
| ``fp32`` | float32 | 0 for fp32 input | 0 | fp32 |
| ``fp16`` | float16 | ``2**-11`` | ``2**-25`` (subnormals) | ``|x| <= 65504``, larger becomes inf |
| ``bf16`` | bfloat16 | ``2**-8`` | ``2**-133`` | fp32 |
| ``fp8`` | uint8 (float8_e4m3fn bytes + fp32 scales) | ``2**-4`` | ``amax_block * 2**-17`` | fp32 |

fp8 scales every block of ``block_size`` consecutive elements (default 64) by its own ``amax / 448``
(448 is float8_e4m3fn's largest value), so blocks of small values keep their precision; the wire holds
``n + 4 * ceil(n / block_size)`` bytes for ``n`` elements. A 2-D ``[R, C]`` tensor encodes row by row
into a 2-D wire and decodes back to ``[R, C]`` (fbgemm's row-wise layout, for callers of the codec
itself). It exists only where torch has ``torch.float8_e4m3fn``.

Decoding always yields float32 (the codecs assume fp32 input, as torchrec's do); the comm ops cast the
result back to their input's dtype.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Dict, Generic, Optional, Sequence, TypeVar

import torch

QuantizationContext = TypeVar("QuantizationContext")

# float8_e4m3fn's largest finite value: a block's amax is scaled to it
_FP8_MAX = 448.0
_FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
_SCALE_BYTES = 4  # one float32 scale per fp8 block


class QuantizedCommCodec(abc.ABC, Generic[QuantizationContext]):
    """Encodes a 1-D chunk for the wire and decodes it back (the specification's interface).

    ``encode(chunk)`` -> a 1-D tensor of ``quantized_dtype`` and ``calc_quantized_size(chunk.numel())``
    elements; ``decode(wire)`` -> the float32 chunk, of the length that was encoded. ``ctx`` carries
    session parameters between encode and decode; the codecs here need none (``create_context``
    returns None). ``sums_on_wire`` says whether a reduce-scatter may sum the encoded values directly
    (true for casts, false for scaled encodings, which a comm op then decodes before summing).
    """

    sums_on_wire: bool = False

    @abc.abstractmethod
    def encode(self, input_tensor: torch.Tensor, ctx: Optional[QuantizationContext] = None) -> torch.Tensor:
        """The wire form of the 1-D ``input_tensor``."""

    @abc.abstractmethod
    def decode(self, input_grad: torch.Tensor, ctx: Optional[QuantizationContext] = None) -> torch.Tensor:
        """The float32 values of a 1-D wire tensor made by ``encode``."""

    @abc.abstractmethod
    def calc_quantized_size(self, input_len: int, ctx: Optional[QuantizationContext] = None) -> int:
        """Number of wire elements that ``encode`` makes of ``input_len`` elements."""

    @property
    @abc.abstractmethod
    def quantized_dtype(self) -> torch.dtype:
        """dtype of the tensors ``encode`` returns."""

    def create_context(self) -> Optional[QuantizationContext]:
        """A context object passed from ``encode`` to ``decode`` (None: these codecs need none)."""
        return None


class CommType(enum.Enum):
    """Wire precision of a ``CastCommCodec`` / ``FP8CommCodec``."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"


_CAST_DTYPES = {CommType.FP32: torch.float32, CommType.FP16: torch.float16, CommType.BF16: torch.bfloat16}


class CastCommCodec(QuantizedCommCodec[None]):
    """Sends values cast to fp32, fp16 or bf16 and decodes to float32; casts may be summed on the wire.

    ``loss_scale`` (torchrec's ``forward_loss_scale`` / ``backward_loss_scale``): values are multiplied
    by it before the cast and divided after, so that small gradients survive fp16's range.
    """

    sums_on_wire = True

    def __init__(self, precision: CommType, loss_scale: Optional[float] = None) -> None:
        if precision not in _CAST_DTYPES:
            raise ValueError(
                f"CastCommCodec supports {sorted(p.value for p in _CAST_DTYPES)}, got {precision}"
            )
        if loss_scale is not None and not loss_scale > 0:
            raise ValueError(f"CastCommCodec: loss_scale must be > 0, got {loss_scale}")
        self.precision = precision
        self.loss_scale = loss_scale
        self._dtype = _CAST_DTYPES[precision]

    def encode(self, input_tensor: torch.Tensor, ctx: None = None) -> torch.Tensor:
        if self.loss_scale is not None:
            input_tensor = input_tensor * self.loss_scale
        return input_tensor.to(self._dtype)

    def decode(self, input_grad: torch.Tensor, ctx: None = None) -> torch.Tensor:
        out = input_grad.to(torch.float32)
        return out if self.loss_scale is None else out / self.loss_scale

    def calc_quantized_size(self, input_len: int, ctx: None = None) -> int:
        return input_len

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self._dtype

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, CastCommCodec)
            and other.precision == self.precision
            and other.loss_scale == self.loss_scale
        )

    def __hash__(self) -> int:
        return hash((CastCommCodec, self.precision, self.loss_scale))

    def __repr__(self) -> str:
        scale = "" if self.loss_scale is None else f", loss_scale={self.loss_scale}"
        return f"CastCommCodec({self.precision.value}{scale})"


class NoOpQuantizedCommCodec(CastCommCodec):
    """The default codec of ``QuantizedCommCodecs``: float32 on the wire (identity for fp32 tensors)."""

    def __init__(self) -> None:
        super().__init__(CommType.FP32)

    def __repr__(self) -> str:
        return "NoOpQuantizedCommCodec()"


class FP8CommCodec(QuantizedCommCodec[None]):
    """float8_e4m3fn values with one float32 scale per block of ``block_size`` elements, sent as bytes.

    Wire layout of ``n`` elements in ``k = ceil(n / block_size)`` blocks: ``k`` scales (``4 * k``
    bytes) then the ``n`` fp8 values. The length is recovered from the wire size alone, because
    ``n + 4 * ceil(n / b)`` grows strictly with ``n``.
    """

    def __init__(self, block_size: int = 64) -> None:
        if _FP8_DTYPE is None:
            raise ValueError("this torch has no torch.float8_e4m3fn, so the fp8 codec is unavailable")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def encode(self, input_tensor: torch.Tensor, ctx: None = None) -> torch.Tensor:
        """A 2-D ``[R, C]`` input gives a 2-D wire ``[R, C + 4 * ceil(C / block_size)]``, each row
        blocked on its own (fbgemm's row-wise layout, so ``decode`` gives ``[R, C]`` back); any other
        input is flattened to one 1-D wire."""
        rows = input_tensor.to(torch.float32)
        rows = rows if rows.dim() == 2 else rows.reshape(1, -1)
        n, blocks = rows.size(1), self._num_blocks(rows.size(1))
        padded = torch.nn.functional.pad(rows, (0, blocks * self.block_size - n))
        padded = padded.view(rows.size(0), blocks, self.block_size)
        amax = padded.abs().amax(dim=2, keepdim=True)
        # an all-zero block keeps scale 1 (any scale decodes zeros exactly); dividing by 0 would give NaN
        scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
        fp8 = (padded / scale).to(_FP8_DTYPE).reshape(rows.size(0), blocks * self.block_size)[:, :n]
        scale_bytes = scale.reshape(rows.size(0), blocks).view(torch.uint8)
        wire = torch.cat([scale_bytes, fp8.view(torch.uint8)], dim=1)
        return wire if input_tensor.dim() == 2 else wire.reshape(-1)

    def decode(self, input_grad: torch.Tensor, ctx: None = None) -> torch.Tensor:
        """``[R, C]`` float32 from a 2-D wire, ``[C]`` from a 1-D one."""
        wire = input_grad if input_grad.dim() == 2 else input_grad.reshape(1, -1)
        blocks = -(-wire.size(1) // (self.block_size + _SCALE_BYTES))
        n = wire.size(1) - _SCALE_BYTES * blocks
        rows = wire.size(0)
        # 1-D copies, so that the float32 view starts at an aligned offset whatever the wire's offset
        scale = wire[:, : _SCALE_BYTES * blocks].reshape(-1).clone().view(torch.float32).view(rows, blocks)
        values = wire[:, _SCALE_BYTES * blocks :].reshape(-1).clone().view(_FP8_DTYPE).view(rows, n)
        values = values.to(torch.float32)
        padded = torch.nn.functional.pad(values, (0, blocks * self.block_size - n))
        padded = padded.view(rows, blocks, self.block_size)
        out = (padded * scale.unsqueeze(2)).reshape(rows, blocks * self.block_size)[:, :n]
        return out if input_grad.dim() == 2 else out.reshape(-1)

    def calc_quantized_size(self, input_len: int, ctx: None = None) -> int:
        return input_len + _SCALE_BYTES * self._num_blocks(input_len)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def _num_blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FP8CommCodec) and other.block_size == self.block_size

    def __hash__(self) -> int:
        return hash((FP8CommCodec, self.block_size))

    def __repr__(self) -> str:
        return f"FP8CommCodec(block_size={self.block_size})"


@dataclasses.dataclass
class QuantizedCommCodecs:
    """The codecs of one comm op: ``forward`` for the forward pass, ``backward`` for the gradients."""

    forward: QuantizedCommCodec = dataclasses.field(default_factory=NoOpQuantizedCommCodec)
    backward: QuantizedCommCodec = dataclasses.field(default_factory=NoOpQuantizedCommCodec)


@dataclasses.dataclass(frozen=True)
class QCommsConfig:
    """Forward and backward wire precisions, as ``CommType`` or its string value (``"fp16"``).

    ``forward_loss_scale`` / ``backward_loss_scale`` (torchrec's): scale values by it before a cast to
    fp16 / bf16 and back after (ignored by fp8, whose blocks carry their own scales).
    """

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    fp8_block_size: int = 64
    forward_loss_scale: Optional[float] = None
    backward_loss_scale: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("forward_precision", "backward_precision"):
            object.__setattr__(self, name, CommType(getattr(self, name)))


def make_codec(
    precision: CommType | str, fp8_block_size: int = 64, loss_scale: Optional[float] = None
) -> QuantizedCommCodec:
    """The codec for one precision: ``CastCommCodec`` for fp32/fp16/bf16, ``FP8CommCodec`` for fp8."""
    precision = CommType(precision)
    if precision is CommType.FP8:
        return FP8CommCodec(fp8_block_size)
    return CastCommCodec(precision, loss_scale)


def get_qcomm_codecs(qcomms_config: Optional[QCommsConfig]) -> QuantizedCommCodecs:
    """``QuantizedCommCodecs`` for a config (both fp32, i.e. no-op on fp32 data, when None)."""
    if qcomms_config is None:
        return QuantizedCommCodecs()
    config = qcomms_config
    return QuantizedCommCodecs(
        forward=make_codec(config.forward_precision, config.fp8_block_size, config.forward_loss_scale),
        backward=make_codec(config.backward_precision, config.fp8_block_size, config.backward_loss_scale),
    )


# torchrec's CommOp names, the registry keys of get_qcomm_codecs_registry
DEFAULT_COMM_OPS = (
    "POOLED_EMBEDDINGS_ALL_TO_ALL",
    "POOLED_EMBEDDINGS_REDUCE_SCATTER",
    "SEQUENCE_EMBEDDINGS_ALL_TO_ALL",
)


def get_qcomm_codecs_registry(
    qcomms_config: QCommsConfig,
    comm_ops: Optional[Sequence[Any]] = None,
    device: Optional[torch.device] = None,
) -> Optional[Dict[str, QuantizedCommCodecs]]:
    """torchrec's registry: ``{comm op name: codecs of qcomms_config}`` for ``comm_ops`` (``CommOp``
    members or their names; default the three embedding output dists), None when both precisions are
    fp32. The sharders accept it as ``qcomm_codecs_registry=``. ``device`` is accepted for torchrec's
    signature: shardkit's codecs run in every precision on gloo and NCCL, so nothing falls back."""
    del device
    if qcomms_config.forward_precision is CommType.FP32 and qcomms_config.backward_precision is CommType.FP32:
        return None
    ops = DEFAULT_COMM_OPS if comm_ops is None else comm_ops
    return {str(getattr(op, "name", op)): get_qcomm_codecs(qcomms_config) for op in ops}


__all__ = [
    "CastCommCodec",
    "CommType",
    "FP8CommCodec",
    "NoOpQuantizedCommCodec",
    "QCommsConfig",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "get_qcomm_codecs",
    "get_qcomm_codecs_registry",
    "make_codec",
]
