"""``torch.utils._pytree`` registration of the jagged types, so that tree utilities (``tree_map``,
``torch.export`` inputs, ...) see their tensors as leaves.

Leaves: ``[values, weights, lengths, offsets]`` as torchrec (weights ``None`` when absent; lengths
and offsets are both always given, the missing one computed: torchrec leaves it ``None``, which makes
the tree spec depend on a cache). The context
keeps what is not a tensor: nothing for a JaggedTensor; the keys, the stride and the
``stride_per_key_per_rank`` of a KeyedJaggedTensor (torchrec keeps the keys only; the variable batch
is kept here so that a round trip gives the same tensor; inverse indices are not carried); the keys,
``length_per_key`` and ``key_dim`` of a KeyedTensor. Unflattening does not validate (the leaves came
from a valid tensor).

A KeyedTensor also has an fx flatten-spec function (``torch.fx._pytree.tree_flatten_spec``, used when an
exported program flattens its inputs by a saved spec): a KeyedTensor whose keys come in another order is
flattened in the spec's key order, as torchrec.
"""

from __future__ import annotations

import json
from typing import Any, List, Optional, Tuple

import torch
from torch.fx._pytree import register_pytree_flatten_spec
from torch.utils._pytree import GetAttrKey, TreeSpec, register_pytree_node

from shardkit.sparse.jagged_tensor import JaggedTensor
from shardkit.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from shardkit.sparse.keyed_tensor import KeyedTensor

Leaves = List[Optional[torch.Tensor]]
# the leaves' names in key paths (torch.export names its inputs by them)
_FIELD_KEYS = [GetAttrKey(name) for name in ("_values", "_weights", "_lengths", "_offsets")]


def _fields(t) -> Leaves:
    # lengths and offsets both, always (the missing one computed, asynchronously): whether a tensor
    # has its offsets cached must not change its tree spec, or an exported program would refuse it
    return [t.values(), t.weights_or_none(), t.lengths(), t.offsets()]


def _jt_unflatten(leaves: Leaves, context: None) -> JaggedTensor:
    values, weights, lengths, offsets = leaves
    return JaggedTensor(values, weights, lengths, offsets, validate=False)


def _kjt_flatten(kjt: KeyedJaggedTensor) -> Tuple[Leaves, Any]:
    variable = kjt.variable_stride_per_key()
    return _fields(kjt), (kjt.keys(), kjt.stride(), kjt.stride_per_key_per_rank() if variable else None)


def _kjt_unflatten(leaves: Leaves, context) -> KeyedJaggedTensor:
    values, weights, lengths, offsets = leaves
    keys, stride, stride_per_key_per_rank = context
    return KeyedJaggedTensor(
        keys,
        values,
        weights,
        lengths,
        offsets,
        stride=stride,
        stride_per_key_per_rank=stride_per_key_per_rank,
        validate=False,
    )


def _kt_flatten(kt: KeyedTensor) -> Tuple[Leaves, Any]:
    return [kt.values()], (kt.keys(), kt.length_per_key(), kt.key_dim())


def _kt_unflatten(leaves: Leaves, context) -> KeyedTensor:
    keys, length_per_key, key_dim = context
    return KeyedTensor(keys, length_per_key, leaves[0], key_dim)


def _kt_flatten_spec(kt: KeyedTensor, spec: TreeSpec) -> Leaves:
    """The values of ``kt`` laid out in the key order of ``spec`` (same keys, maybe another order)."""
    keys = spec.context[0]
    if kt.keys() == keys:
        return [kt.values()]
    return [KeyedTensor.regroup([kt], [keys])[0]]


def _with_keys(flatten, keys=_FIELD_KEYS):
    """A ``flatten_with_keys_fn`` from a ``flatten_fn``: each leaf paired with its attribute key."""

    def flatten_with_keys(tree):
        leaves, context = flatten(tree)
        return list(zip(keys, leaves)), context

    return flatten_with_keys


def _context_to_json(context: Any) -> str:
    return json.dumps(context)


def _context_from_json(dumped: str) -> Tuple[Any, ...]:
    # the context is a tuple when flattened; JSON brings it back as a list, and torch.export compares
    # a loaded program's input spec with the caller's by equality, so restore the tuple
    return tuple(json.loads(dumped))


def _jt_flatten(jt: JaggedTensor) -> Tuple[Leaves, Any]:
    return _fields(jt), None


register_pytree_node(
    JaggedTensor,
    _jt_flatten,
    _jt_unflatten,
    serialized_type_name="shardkit.JaggedTensor",
    flatten_with_keys_fn=_with_keys(_jt_flatten),
)
register_pytree_node(
    KeyedJaggedTensor,
    _kjt_flatten,
    _kjt_unflatten,
    serialized_type_name="shardkit.KeyedJaggedTensor",
    flatten_with_keys_fn=_with_keys(_kjt_flatten),
    to_dumpable_context=_context_to_json,
    from_dumpable_context=_context_from_json,
)
register_pytree_node(
    KeyedTensor,
    _kt_flatten,
    _kt_unflatten,
    serialized_type_name="shardkit.KeyedTensor",
    flatten_with_keys_fn=_with_keys(_kt_flatten, [GetAttrKey("_values")]),
    to_dumpable_context=_context_to_json,
    from_dumpable_context=_context_from_json,
)
register_pytree_flatten_spec(KeyedTensor, _kt_flatten_spec)
