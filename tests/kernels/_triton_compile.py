"""Compile the Triton embedding kernels for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter runs the kernels' semantics but not its GPU compiler, which can fail for one
specialization and not another (it did for the fused backward with ``D = 16``: a layout pass of Triton
3.6). ``triton.compile`` with an explicit target runs that compiler on any machine.
"""

from __future__ import annotations

from typing import Dict, Iterable

PTRS = {
    "weight_ptr": "*fp32",
    "sorted_rows_ptr": "*i32",
    "order_ptr": "*i64",
    "starts_ptr": "*i64",
    "num_segs_ptr": "*i64",
    "bag_ptr": "*i64",
    "psw_ptr": "*fp32",
    "scale_ptr": "*fp32",
    "grad_ptr": "*fp32",
    "state0_ptr": "*fp32",
    "state1_ptr": "*fp32",
    "psw_grad_ptr": "*fp32",
    "long_count_ptr": "*i32",
    "long_list_ptr": "*i64",
}
SCALARS = {
    "num_rows": "i32",
    "D": "i32",
    "float_D": "fp32",
    "neg_lr": "fp32",
    "eps": "fp32",
    "one_minus_beta1": "fp32",
    "one_minus_beta2": "fp32",
    "neg_step_size": "fp32",
}


def compile_for_sm90(fn, constexprs: Dict[str, object], weight_type: str, divisible_by_16: Iterable[str]):
    """``triton.compile`` of jit function ``fn`` for sm_90; pointers are 16-byte aligned, as torch's are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    types = {**PTRS, **SCALARS, "weight_ptr": weight_type}
    signature, values = {}, {}
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            values[(index,)] = constexprs[name]
        else:
            signature[name] = types[name]
    aligned = [name for name in names if name in PTRS or name in set(divisible_by_16)]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, signature, values, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
