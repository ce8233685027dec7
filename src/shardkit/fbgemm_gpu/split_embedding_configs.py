"""fbgemm's ``fbgemm_gpu.split_embedding_configs``: ``EmbOptimType`` and ``SparseType``.

``EmbOptimType`` is shardkit's ``OptimType`` itself, so a sharder's ``fused_params={"optimizer":
EmbOptimType.EXACT_ROWWISE_ADAGRAD}`` trains with shardkit's row-wise Adagrad. fbgemm's members that
have no shardkit kernel (``PARTIAL_ROWWISE_ADAM``, ``LAMB``, ``LARS_SGD``, ``SHAMPOO``, ...) are an
``AttributeError``, as on ``OptimType``.
"""

from __future__ import annotations

import enum

import torch

from shardkit.modules.fused_optimizers import OptimType

EmbOptimType = OptimType

# fbgemm's integer codes, torch storage dtypes and bits per element of each member
_AS_INT = {"fp32": 0, "fp16": 1, "int8": 2, "int4": 3, "int2": 4, "bf16": 5, "fp8": 6}
_BIT_RATE = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2, "bf16": 16, "fp8": 8}


class SparseType(enum.Enum):
    """fbgemm's storage / output precision of a table (``SparseType.FP16.as_dtype()``, ...).

    fbgemm's ``MX4`` / ``NFP8`` are not here (shardkit has no such storage)."""

    FP32 = "fp32"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value

    @staticmethod
    def from_int(ty: int) -> SparseType:
        for member in SparseType:
            if _AS_INT[member.value] == ty:
                return member
        raise ValueError(f"unsupported sparse type code {ty}; known: {sorted(_AS_INT.values())}")

    def as_int(self) -> int:
        return _AS_INT[self.value]

    @staticmethod
    def from_dtype(dtype: torch.dtype) -> SparseType:
        found = {
            torch.float32: SparseType.FP32,
            torch.float16: SparseType.FP16,
            torch.bfloat16: SparseType.BF16,
            torch.int8: SparseType.INT8,
            torch.uint8: SparseType.INT8,
            torch.quint4x2: SparseType.INT4,
            torch.quint2x4: SparseType.INT2,
        }.get(dtype)
        if found is None:
            raise ValueError(f"no SparseType for dtype {dtype}")
        return found

    def as_dtype(self) -> torch.dtype:
        return {
            "fp32": torch.float32,
            "fp16": torch.float16,
            "fp8": torch.uint8,
            "int8": torch.uint8,
            "int4": torch.quint4x2,
            "int2": torch.quint2x4,
            "bf16": torch.bfloat16,
        }[self.value]

    def bit_rate(self) -> int:
        return _BIT_RATE[self.value]

    def is_float(self) -> bool:
        return self in (SparseType.FP32, SparseType.FP16, SparseType.FP8, SparseType.BF16)
