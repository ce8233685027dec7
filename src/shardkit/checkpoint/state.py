"""What a checkpoint holds, and the staging copies a load reads into before touching the model.

A checkpoint's state dict is ``{"model": model.state_dict(), "optim": ...}``: the model's own
(sharded modules give one DTensor / ShardedTensor per table, docs/sharded_state.md) and the
optimizers' (one object, or a mapping of names to optimizers, each under its name).

- shardkit's fused optimizers and ``CombinedOptimizer`` (anything with ``optimizers`` as
  ``(key, optimizer)`` pairs) save their own ``state_dict()``;
- a ``KeyedOptimizer`` (torchrec's: its state dict already names the parameters) saves its own
  ``state_dict()`` too (call ``init_state()`` before loading into one that has not stepped);
- another ``torch.optim.Optimizer`` is saved with its state keyed by parameter *name* (``model``'s
  ``named_parameters``) instead of by position, and its param groups' hyper-parameters by position
  (their parameters are the loading optimizer's own): a name means the same parameter at any world
  size, and a load into an optimizer that has not stepped yet (no state) builds its state from the
  checkpoint's metadata instead of silently skipping it. State of a parameter that holds shards
  (a DENSE-kernel table's buffer) is refused: it differs per rank under one name.

``staging_copy`` clones every tensor of a state dict (DTensor / ShardedTensor: their local shards,
with the same placements), so ``dcp.load`` can fill the copy while the model's tensors stay as they
were until every rank has read everything.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard as TorchShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from shardkit.checkpoint.manifest import CheckpointError
from shardkit.kernels.offload.backing_store import file_backed_copies, store_of
from shardkit.modules.optimizer_facade import OptimizerFacade
from shardkit.optim.keyed_optimizer import KeyedOptimizer

Path = Tuple[str, ...]


def _param_names(model: nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def _sharded_parameters(model: nn.Module) -> set:
    """ids of the parameters that hold shards (each rank its own piece under one name)."""
    ids = set()
    for sub in model.modules():
        names = getattr(sub, "sharded_parameter_names", None)
        if callable(names):
            ids.update(id(sub.get_parameter(n)) for n in names())
    return ids


def _torch_order(optimizer: torch.optim.Optimizer, names: Dict[int, str], key: str) -> List[Any]:
    """``optimizer``'s parameters in its state-dict index order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if id(p) not in names:
            raise CheckpointError(
                f"optimizer {key!r} holds a parameter of shape {tuple(p.shape)} that is not one of "
                "the model's parameters; a checkpoint names optimizer state by parameter name"
            )
    return params


def _positional(optimizer: Any) -> bool:
    """A torch optimizer whose state dict numbers its parameters (a KeyedOptimizer names them; a
    facade such as a fused or combined optimizer has a state dict of its own)."""
    return isinstance(optimizer, torch.optim.Optimizer) and not isinstance(
        optimizer, (KeyedOptimizer, OptimizerFacade)
    )


def optimizer_state(
    optimizer: Any, model: nn.Module, names: Dict[int, str], key: str, path: Path, fill: List[Path]
) -> Any:
    """``optimizer``'s state to save (see the module doc); appends to ``fill`` the paths (under
    ``path``) whose contents a load must take from the checkpoint's metadata."""
    if _positional(optimizer):
        params = _torch_order(optimizer, names, key)
        sharded = _sharded_parameters(model)
        sd = optimizer.state_dict()
        state = {}
        for i, value in sd["state"].items():
            if id(params[i]) in sharded:
                if value:
                    raise CheckpointError(
                        f"optimizer {key!r} has state for {names[id(params[i])]!r}, which holds this rank's "
                        "shards: a torch optimizer's per-shard state cannot be checkpointed (use a fused "
                        "optimizer for sharded tables)"
                    )
                continue
            state[names[id(params[i])]] = dict(value)
        fill.append(path + ("state",))
        # the groups' hyper-parameters by position; their parameters are the loading optimizer's own
        # (a sharded module's parameter names depend on the plan)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}
    if hasattr(optimizer, "optimizers"):  # CombinedOptimizer: its parts under their keys
        return {
            k: optimizer_state(opt, model, names, f"{key}.{k}", path + (k,), fill)
            for k, opt in optimizer.optimizers
        }
    if not (hasattr(optimizer, "state_dict") and hasattr(optimizer, "load_state_dict")):
        raise CheckpointError(
            f"optimizer {key!r} ({type(optimizer).__name__}) has no state_dict / load_state_dict"
        )
    return optimizer.state_dict()


def _shape_problems(
    optimizer: Any, params: List[Any], position: Dict[str, int], state: Any, key: str
) -> List[str]:
    """The saved per-parameter tensors whose shapes cannot be this optimizer's: another shape than
    the state it holds under that name, or (no state yet) the parameter's element count in another
    shape (``torch.optim`` would load either silently and fail, or broadcast, at the next step)."""
    problems = []
    for name, saved in state["state"].items():
        param = params[position[name]]
        current = optimizer.state.get(param, {})
        for entry, value in (saved or {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            have = current.get(entry)
            if isinstance(have, torch.Tensor):
                expected = tuple(have.shape)
            elif value.numel() == param.numel() > 1:  # (a one-element one may be a step count)
                expected = tuple(param.shape)
            else:
                continue
            if tuple(value.shape) != expected:
                problems.append(
                    f"optimizer {key!r}: state {entry!r} of {name!r} has shape {tuple(value.shape)}, "
                    f"expected {expected}"
                )
    return problems


def check_optimizer_state(optimizer: Any, state: Any, names: Dict[int, str], key: str) -> List[str]:
    """What would make :func:`load_optimizer_state` refuse ``state`` (filled by a checkpoint), found
    without writing anything: a load runs this for every optimizer on every rank first."""
    if _positional(optimizer):
        try:
            params = _torch_order(optimizer, names, key)
        except CheckpointError as err:
            return [str(err)]
        position = {names[id(p)]: i for i, p in enumerate(params)}
        problems = []
        unknown = sorted(set(state["state"]) - set(position))
        if unknown:
            problems.append(
                f"optimizer {key!r}: the checkpoint has state of parameters this optimizer does not hold "
                f"{unknown[:5]}"
            )
        if len(optimizer.param_groups) != len(state["param_groups"]):
            problems.append(
                f"optimizer {key!r}: {len(state['param_groups'])} param groups saved, "
                f"{len(optimizer.param_groups)} here"
            )
        if not unknown:
            problems += _shape_problems(optimizer, params, position, state, key)
        return problems
    if hasattr(optimizer, "optimizers"):
        return [
            p
            for k, opt in optimizer.optimizers
            for p in (
                check_optimizer_state(opt, state[k], names, f"{key}.{k}")
                if k in state
                else [f"optimizer {key!r}: the checkpoint has no state of {k!r}"]
            )
        ]
    check = getattr(optimizer, "check_state_dict", None)
    return [f"optimizer {key!r}: {p}" for p in check(state)] if callable(check) else []


def load_optimizer_state(optimizer: Any, state: Any, names: Dict[int, str], key: str) -> None:
    """Load what :func:`optimizer_state` gave (filled by a checkpoint) back into ``optimizer``; call
    :func:`check_optimizer_state` first (this writes as it goes)."""
    if _positional(optimizer):
        params = _torch_order(optimizer, names, key)
        position = {names[id(p)]: i for i, p in enumerate(params)}
        current = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict(
            {
                "state": {position[n]: v for n, v in state["state"].items()},
                "param_groups": [
                    {**g, "params": c["params"]} for g, c in zip(state["param_groups"], current)
                ],
            }
        )
    elif hasattr(optimizer, "optimizers"):
        for k, opt in optimizer.optimizers:
            load_optimizer_state(opt, state[k], names, f"{key}.{k}")
    else:
        optimizer.load_state_dict(state)


def optimizers_by_key(optimizers: Any) -> Optional[Dict[str, Any]]:
    """``{key: optimizer}`` for a mapping; ``None`` for None; a single optimizer stays unkeyed."""
    if optimizers is None or not isinstance(optimizers, Mapping):
        return None
    return dict(optimizers)


def checkpoint_state(model: nn.Module, optimizers: Any) -> Tuple[Dict[str, Any], List[Path]]:
    """``({"model": ..., "optim": ...}, paths to fill from metadata on load)``; values alias the model."""
    state: Dict[str, Any] = {"model": model.state_dict()}
    fill: List[Path] = []
    if optimizers is not None:
        names = _param_names(model)
        keyed = optimizers_by_key(optimizers)
        if keyed is None:
            state["optim"] = optimizer_state(optimizers, model, names, "optim", ("optim",), fill)
        else:
            state["optim"] = {
                k: optimizer_state(o, model, names, k, ("optim", k), fill) for k, o in keyed.items()
            }
    return state, fill


def set_aside_absent_records(state: Dict[str, Any], metadata: Metadata) -> List[str]:
    """Remove from ``state["model"]`` the non-tensor records (a managed-collision bucket's eviction
    window) that the checkpoint does not hold, and return their keys: ``dcp.load`` would fail on them
    before :func:`check_state` can say why (a map saved with fewer buckets has no window for the
    others), and :func:`check_state` refuses the load while any is left."""
    model = state["model"]
    absent = [
        key
        for key, value in model.items()
        if not isinstance(value, torch.Tensor) and f"model.{key}" not in metadata.state_dict_metadata
    ]
    for key in absent:
        del model[key]
    return absent


def check_state(
    model: nn.Module, state: Dict[str, Any], absent: Sequence[str] = (), optimizers: Any = None
) -> None:
    """``CheckpointError`` if a module of ``model`` would refuse its part of the filled
    :func:`checkpoint_state`, or the checkpoint lacks records of the model (``absent``): modules that
    define ``check_state_dict(state_dict, prefix) -> [problems]`` (the managed-collision maps) are
    asked before anything is written, so that a refused load leaves the model as it was. Their key
    prefixes are the ones ``model.state_dict()`` gives them. Every optimizer's part is checked too
    (:func:`check_optimizer_state`): nothing that :func:`apply_state` writes can be refused after
    the first write."""
    checkers = [m for m in model.modules() if callable(getattr(m, "check_state_dict", None))]
    found: List[Tuple[nn.Module, str]] = []
    handles = [
        m.register_state_dict_pre_hook(lambda m, prefix, keep_vars: found.append((m, prefix)))
        for m in checkers
    ]
    try:
        model.state_dict()
    finally:
        for handle in handles:
            handle.remove()
    problems = [p for module, prefix in found for p in module.check_state_dict(state["model"], prefix)]
    problems += [f"it has no record {key!r}" for key in absent[:8]]
    problems += [f"and {len(absent) - 8} more records are missing"] if len(absent) > 8 else []
    if optimizers is not None:
        names = _param_names(model)
        keyed = optimizers_by_key(optimizers)
        if keyed is None:
            problems += check_optimizer_state(optimizers, state["optim"], names, "optim")
        else:
            problems += [
                p for k, opt in keyed.items() for p in check_optimizer_state(opt, state["optim"][k], names, k)
            ]
    if problems:
        raise CheckpointError(
            "the checkpoint does not fit the model (nothing was loaded): " + "; ".join(problems)
        )


def apply_state(model: nn.Module, optimizers: Any, state: Dict[str, Any]) -> None:
    """Copy a filled :func:`checkpoint_state` into the model and the optimizers; :func:`check_state`
    (with the optimizers) must have passed on every rank."""
    model.load_state_dict(state["model"])
    if optimizers is None:
        return
    names = _param_names(model)
    keyed = optimizers_by_key(optimizers)
    if keyed is None:
        load_optimizer_state(optimizers, state["optim"], names, "optim")
    else:
        for k, opt in keyed.items():
            load_optimizer_state(opt, state["optim"][k], names, k)


def _staged(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """New copies of ``tensors`` (the local pieces of one value): in RAM, or, for pieces of an offloaded
    table's backing file, in one scratch file next to it (copied in row chunks): staging never holds
    an offloaded table in RAM."""
    out = [t.detach() for t in tensors]
    offloaded = [(i, store_of(t)) for i, t in enumerate(out)]
    offloaded = [(i, s) for i, s in offloaded if s is not None]
    if offloaded:
        directory = os.path.dirname(offloaded[0][1].path) if offloaded[0][1].path else None
        copies = file_backed_copies([out[i] for i, _ in offloaded], directory)
        for (i, _), copy in zip(offloaded, copies):
            out[i] = copy
    done = {i for i, _ in offloaded}
    return [t if i in done else t.clone() for i, t in enumerate(out)]


def staging_copy(value: Any) -> Any:
    """A copy of a (nested) state dict whose tensors are new: DTensor / ShardedTensor keep their
    placements with copied local shards (pieces of offloaded tables copied into scratch files, not
    RAM); other values are shared (``dcp.load`` replaces them)."""
    if isinstance(value, Mapping):
        return {k: staging_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [staging_copy(v) for v in value]
    if isinstance(value, DTensor):
        return DTensor.from_local(
            _staged([value.to_local()])[0],
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, ShardedTensor):
        local = value.local_shards()
        copies = _staged([s.tensor for s in local])
        shards = [TorchShard(copy, s.metadata) for copy, s in zip(copies, local)]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, value.metadata())
    if isinstance(value, torch.Tensor):
        return _staged([value])[0]
    return value


def fill_from_metadata(state: Dict[str, Any], fill: List[Path], metadata: Metadata, model: nn.Module) -> None:
    """Replace the subtree at each path of ``fill`` (a torch optimizer's per-parameter state) by what
    the checkpoint holds there: new tensors of the saved shapes and dtypes (``dcp.load`` fills them),
    placeholders for other values. A saved tensor larger than its parameter is refused before
    anything is allocated (the metadata is untrusted)."""
    numel = {name: p.numel() for name, p in model.named_parameters(remove_duplicate=False)}
    mapping = getattr(metadata, "planner_data", None)
    if fill and not isinstance(mapping, dict):
        raise CheckpointError(
            "the checkpoint's metadata has no key paths (it was not saved by shardkit.checkpoint)"
        )
    for prefix in fill:
        node = state
        for part in prefix[:-1]:
            node = node[part]
        subtree: Dict[str, Any] = {}
        node[prefix[-1]] = subtree
        for fqn, entry in metadata.state_dict_metadata.items():
            path = tuple(mapping.get(fqn, ()))
            if path[: len(prefix)] != prefix or len(path) <= len(prefix):
                continue
            leaf = subtree
            for part in path[len(prefix) : -1]:
                leaf = leaf.setdefault(str(part), {})
            if isinstance(entry, TensorStorageMetadata):
                param = str(path[len(prefix)])
                size = 1
                for n in entry.size:
                    size *= int(n)
                if size > numel.get(param, 0):
                    raise CheckpointError(
                        f"the checkpoint's optimizer state {fqn!r} has shape {tuple(entry.size)}, larger "
                        f"than parameter {param!r} ({numel.get(param, 'not in the model')} elements)"
                    )
                leaf[str(path[-1])] = torch.empty(entry.size, dtype=entry.properties.dtype)
            else:
                leaf[str(path[-1])] = None
    if isinstance(mapping, dict) and isinstance(state.get("optim"), Mapping):
        _saved_group_counts(state["optim"], ("optim",), mapping)


def _saved_group_counts(node: Mapping[str, Any], path: Path, mapping: Dict[str, Any]) -> None:
    """:func:`_saved_group_count` for every optimizer's ``param_groups`` list under ``node``."""
    for key, value in node.items():
        if key == "param_groups" and isinstance(value, list):
            _saved_group_count(node, path + (key,), mapping)
        elif isinstance(value, Mapping):
            _saved_group_counts(value, path + (key,), mapping)


def _saved_group_count(node: Dict[str, Any], groups: Path, mapping: Dict[str, Any]) -> None:
    """Give the staged ``param_groups`` list (the loading optimizer's own) as many entries as the
    checkpoint saved, so that :func:`check_optimizer_state` sees a different count and refuses it:
    otherwise ``dcp.load`` would silently leave extra saved groups unread."""
    indices = set()
    for path in mapping.values():
        path = tuple(path)
        if path[: len(groups)] == groups and len(path) > len(groups):
            try:
                indices.add(int(path[len(groups)]))
            except (TypeError, ValueError):
                continue
    staged = node.get(groups[-1])
    if not isinstance(staged, list) or not staged:
        return
    count = max(indices) + 1 if indices else 0
    del staged[count:]
    while len(staged) < count:
        staged.append(dict(staged[-1]))


__all__ = [
    "apply_state",
    "check_optimizer_state",
    "check_state",
    "checkpoint_state",
    "fill_from_metadata",
    "set_aside_absent_records",
    "staging_copy",
]
