"""ShardedManagedCollisionCollection and its sharder (the specification's ``mc_modules``).

Each table's map lives with the table's rows. ROW_WISE: the table's buckets (``MCHManagedCollisionModule``)
are cut where the rows are cut, so each rank owns the buckets of its row block: a contiguous range of
slots and of the hashed id space (a module built with one bucket is cut into ``world_size`` buckets).
TABLE_WISE and COLUMN_WISE: the whole map lives on the rank of the table's first shard.

forward(features: this rank's KJT) -> remapped KJT (this rank's samples, the tables' features in
table order), in three steps:

1. ``input_dist``: check the input on every rank (errors reach every rank), hash the ids
   (``preprocess``), and send each id to the rank owning its bucket (one all-to-all of counts, one of ids);
2. ``compute``: each owner profiles (training) and remaps the ids it received, all ranks' ids of a
   bucket together, so the map sees the global batch;
3. ``output_dist``: the slots go back to the ranks the ids came from (one all-to-all), together with
   every owner's evicted slots, so that every rank learns ``evictions_per_table`` and can reset the rows
   it holds of any table.

The result equals the *unsharded equivalent* (docs/managed_collision.md): the same
``ManagedCollisionCollection`` with each row-wise table's module cut into the sharded bucket count,
fed the concatenation of all ranks' batches.

State dict: the unsharded keys (``_managed_collision_modules.<table>.<buffer>``); the ``[zch_size]``
buffers as DTensor / ShardedTensor values sharded like the table's rows (TABLE_WISE / COLUMN_WISE: one
shard on the owner), ``_current_iter_tensor`` and ``_buckets_tensor`` as plain (replicated) tensors,
so torch.distributed.checkpoint reshards them to any world size whose row blocks are whole buckets;
and each bucket's eviction window (``_mch_window_<bucket>``, from the rank holding the bucket), so a
resume between two evictions continues exactly.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.agreement import gather_objects
from shardkit.distributed.awaitable import Awaitable, LazyAwaitable, NoWait
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.topology import get_local_size
from shardkit.distributed.validation import validation_enabled
from shardkit.modules.mc_collection import ManagedCollisionCollection, in_feature_order, replace_values
from shardkit.modules.mc_modules import MCHManagedCollisionModule
from shardkit.modules.mc_state import WINDOW_KEY
from shardkit.sharding.embedding_sharding import ShardedTable, sharded_table
from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.sharded_state import load_state_value, to_state_value
from shardkit.sharding.sharding_plan import placement
from shardkit.sharding.sharding_spec import ShardMetadata
from shardkit.sharding.state_layout import ShardLayout
from shardkit.sharding.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardedModule,
    ShardingType,
)
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor

MC_SHARDING_TYPES = [
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
]
_REPLICATED_BUFFERS = ("_current_iter_tensor", "_buckets_tensor")


class ManagedCollisionCollectionContext:
    """One forward's context: the input in table order (``input_features``), the routing of the ids
    (``send_order``, ``send_counts`` / ``recv_counts`` ``[world, tables]``) and, after the output dist,
    ``evictions_per_table``. ``sharding_contexts`` / ``reverse_indices`` are kept for the specification."""

    def __init__(self) -> None:
        self.sharding_contexts: list = []
        self.input_features: List[KeyedJaggedTensor] = []
        self.reverse_indices: List[torch.Tensor] = []
        self.send_order: Optional[torch.Tensor] = None
        self.send_counts: Optional[torch.Tensor] = None
        self.recv_counts: Optional[torch.Tensor] = None
        self.evictions_per_table: Dict[str, Optional[torch.Tensor]] = {}

    def record_stream(self, stream: torch.Stream) -> None:
        for kjt in self.input_features:
            kjt.record_stream(stream)


class ManagedCollisionCollectionAwaitable(LazyAwaitable[KeyedJaggedTensor]):
    """The remapped KJT of an output dist that already completed."""

    def __init__(self, remapped: KeyedJaggedTensor) -> None:
        super().__init__()
        self._remapped = remapped

    def _wait_impl(self) -> KeyedJaggedTensor:
        return self._remapped


class _TableRouting:
    """Where a table's map lives: ``owners[b]`` is the rank holding bucket ``b``; ``blocks[r]`` the
    slots ``[start, end)`` rank ``r`` holds (empty when none)."""

    def __init__(self, owners: List[int], blocks: List[Tuple[int, int]]) -> None:
        self.owners = owners
        self.blocks = blocks


def _route_table(
    table: ShardedTable, module: MCHManagedCollisionModule, world_size: int
) -> Tuple[MCHManagedCollisionModule, _TableRouting]:
    """The table's (possibly re-bucketed) module and its routing; ``ValueError`` naming the table."""
    name, zch = table.name, module.output_size()
    if table.sharding_type not in MC_SHARDING_TYPES:
        raise ValueError(
            f"table {name!r}: a managed collision table can be sharded {MC_SHARDING_TYPES}, "
            f"not {table.sharding_type}"
        )
    if table.sharding_type != ShardingType.ROW_WISE.value:
        owner = table.shards[0].rank
        blocks = [(0, zch) if r == owner else (0, 0) for r in range(world_size)]
        return module, _TableRouting([owner] * module.buckets(), blocks)
    if module.buckets() == 1 and world_size > 1:
        try:
            module = module.with_buckets(world_size)
        except ValueError as err:
            raise ValueError(
                f"table {name!r}: {err}; build it with buckets={world_size} (or a multiple) to shard it "
                f"row-wise over {world_size} ranks"
            ) from None
    size = zch // module.buckets()
    blocks = [(0, 0)] * world_size
    owners = [-1] * module.buckets()
    for shard in table.shards:
        if shard.row_start % size or shard.row_end % size:
            raise ValueError(
                f"table {name!r}: rank {shard.rank}'s rows [{shard.row_start}, {shard.row_end}) are not "
                f"whole buckets of {size} slots (zch_size {zch}, {module.buckets()} buckets); make "
                f"zch_size and buckets divisible by the world size {world_size}"
            )
        blocks[shard.rank] = (shard.row_start, shard.row_end)
        for bucket in range(shard.row_start // size, shard.row_end // size):
            owners[bucket] = shard.rank
    return module, _TableRouting(owners, blocks)


class ShardedManagedCollisionCollection(ShardedModule):
    """A ManagedCollisionCollection whose maps live with their tables' rows (see the module docstring).

    Args:
        module: the unsharded collection (its modules' state is copied into the owners' slices).
        table_name_to_parameter_sharding: the tables' plan (the embedding module's plan).
        env: the world.
        device: where the maps live.
        sharding_type_to_sharding: accepted for the specification's signature; not used.
        qcomm_codecs_registry: not used (ids travel as int64).
    """

    def __init__(
        self,
        module: ManagedCollisionCollection,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        sharding_type_to_sharding: Optional[dict] = None,
        qcomm_codecs_registry: Optional[dict] = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        self._env = env
        self._device = torch.device(device or "cpu")
        self.need_preprocess = module.need_preprocess
        self._configs = module.embedding_configs()
        self._feature_names = module.feature_names()
        self._feature_splits = [len(c.feature_names) for c in self._configs]
        self._permutations: Dict[tuple, Optional[List[int]]] = {}
        self._global: Dict[str, MCHManagedCollisionModule] = {}  # config, hash, bucket rule (no state)
        self._routing: Dict[str, _TableRouting] = {}
        self._owners: Dict[str, torch.Tensor] = {}
        self._layouts: Dict[str, Dict[str, ShardLayout]] = {}
        self._iters: Dict[str, torch.Tensor] = {}
        self._managed_collision_modules = nn.ModuleDict()
        error, fingerprint = None, []
        try:
            for config in self._configs:
                source = module._managed_collision_modules[config.name]
                if not isinstance(source, MCHManagedCollisionModule):
                    raise TypeError(f"table {config.name!r}: only MCHManagedCollisionModule can be sharded")
                ps = table_name_to_parameter_sharding.get(config.name)
                if ps is None:
                    raise KeyError(f"the plan has no sharding for managed collision table {config.name!r}")
                table = sharded_table(config, ps, env.world_size)
                global_module, routing = _route_table(table, source, env.world_size)
                self._install(config.name, source, global_module, routing)
                fingerprint.append((config.name, table.sharding_type, global_module.config()))
        except (KeyError, ValueError, TypeError) as err:
            error = f"{type(err).__name__}: {err}"
        verdicts = gather_objects((error, fingerprint), env.process_group)
        problems = [f"rank {r}: {e}" for r, (e, _) in enumerate(verdicts) if e is not None]
        if problems:
            raise ValueError("cannot shard the managed collision collection: " + "; ".join(problems))
        if any(fp != verdicts[0][1] for _, fp in verdicts[1:]):
            raise ValueError(
                "ranks disagree on the managed collision configuration (zch_size, buckets, "
                "input_hash_size, eviction policy or interval, or sharding type of some table)"
            )
        self.register_state_dict_post_hook(_maps_to_state_dict)
        self.register_load_state_dict_pre_hook(_maps_from_state_dict)

    def _install(
        self,
        name: str,
        source: MCHManagedCollisionModule,
        global_module: MCHManagedCollisionModule,
        routing: _TableRouting,
    ) -> None:
        self._global[name] = global_module
        self._routing[name] = routing
        self._owners[name] = torch.tensor(routing.owners, device=self._device)
        self._iters[name] = source._current_iter_tensor.detach().clone().to(self._device)
        start, end = routing.blocks[self._env.rank]
        if end > start:
            local = global_module.rebuild_with_output_id_range((start, end), device=self._device)
            local._buffers["_current_iter_tensor"] = self._iters[name]  # one counter per table and rank
            with torch.no_grad():
                for buffer, value in _sliced_buffers(source).items():
                    getattr(local, buffer).copy_(value[start:end])
            self._managed_collision_modules[name] = local
        zch, local_size = source.output_size(), get_local_size(self._env.world_size)
        shards = tuple(
            ShardMetadata([a], [b - a], placement(r, self._device.type, local_size))
            for r, (a, b) in enumerate(routing.blocks)
            if b > a
        )
        self._layouts[name] = {
            buffer: ShardLayout(f"{name}.{buffer}", (zch,), shards) for buffer in _sliced_buffers(source)
        }

    # ---- forward ------------------------------------------------------------------------------

    def create_context(self) -> ManagedCollisionCollectionContext:
        return ManagedCollisionCollectionContext()

    def _table_ids(self, features: KeyedJaggedTensor) -> List[torch.Tensor]:
        """Each table's preprocessed ids (its features' values together), checked against the map."""
        per_key = features.length_per_key()
        out, start = [], 0
        for config, count in zip(self._configs, self._feature_splits):
            n = sum(per_key[start : start + count])
            first = sum(per_key[:start])
            start += count
            ids = features.values()[first : first + n]
            module = self._global[config.name]
            if self.need_preprocess:
                jt = JaggedTensor(ids, lengths=ids.new_tensor([ids.numel()]))
                ids = module.preprocess({"t": jt})["t"].values()
            module.check_ids(ids, f" of table {config.name!r}")
            out.append(ids)
        return out

    def input_dist(
        self, ctx: ManagedCollisionCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        """Check, hash and send each id to the owner of its bucket (two all-to-alls, completed here)."""
        error, table_ids = None, []
        try:
            features = in_feature_order(features, self._feature_names, self._permutations)
            table_ids = self._table_ids(features)
        except (KeyError, ValueError, IndexError) as err:
            error = f"{type(err).__name__}: {err}"
        if validation_enabled() or error is not None:
            verdicts = gather_objects(error, self._env.process_group) if validation_enabled() else [error]
            problems = [f"rank {r}: {e}" for r, e in enumerate(verdicts) if e is not None]
            if problems:
                raise ValueError("invalid managed collision input: " + "; ".join(problems))
        world, tables = self._env.world_size, len(self._configs)
        keys = [
            self._owners[c.name][self._global[c.name].bucket_of(ids)] * tables + t
            for t, (c, ids) in enumerate(zip(self._configs, table_ids))
        ]
        key = torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64, device=self._device)
        order = torch.argsort(key, stable=True)
        send = torch.cat(table_ids)[order]
        send_counts = torch.bincount(key, minlength=world * tables).view(world, tables)
        recv_counts = self._all_to_all(send_counts.reshape(-1), [tables] * world, [tables] * world)
        recv_counts = recv_counts.view(world, tables)
        received = self._all_to_all(send, send_counts.sum(1).tolist(), recv_counts.sum(1).tolist())
        ctx.input_features = [features]
        ctx.send_order, ctx.send_counts, ctx.recv_counts = order, send_counts, recv_counts
        return NoWait(NoWait(KJTList([_ids_kjt(received)])))

    def _all_to_all(self, send: torch.Tensor, send_splits: List[int], recv_splits: List[int]) -> torch.Tensor:
        if self._env.world_size == 1:
            return send.clone()
        out = send.new_empty(sum(recv_splits))
        dist.all_to_all_single(out, send, recv_splits, send_splits, group=self._env.process_group)
        return out

    @torch.no_grad()
    def compute(self, ctx: ManagedCollisionCollectionContext, dist_input: KJTList) -> KJTList:
        """Profile (training) and remap, per table, the ids this rank received for its buckets."""
        received = dist_input[0].values()
        slots = torch.empty_like(received)
        counts = ctx.recv_counts
        starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
        tables = len(self._configs)
        for t, config in enumerate(self._configs):
            local = (
                self._managed_collision_modules[config.name]
                if config.name in self._managed_collision_modules
                else None
            )
            if local is None:
                if self.training:
                    self._iters[config.name] += 1
                continue
            pieces = [
                torch.arange(int(starts[s * tables + t]), int(starts[s * tables + t] + counts[s, t]))
                for s in range(self._env.world_size)
            ]
            index = torch.cat(pieces).to(received.device)
            ids = received[index]
            if self.training:
                local.profile_ids(ids)
            slots[index] = local.remap_ids(ids)
        return KJTList([_ids_kjt(slots)])

    def _eviction_payload(self) -> torch.Tensor:
        """``[table index, count, slots...]`` for each table this rank evicted in."""
        parts = []
        for t, config in enumerate(self._configs):
            if config.name in self._managed_collision_modules:
                evicted = self._managed_collision_modules[config.name].evict()
                if evicted is not None:
                    parts.append(torch.tensor([t, evicted.numel()], device=evicted.device))
                    parts.append(evicted)
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=self._device)

    def output_dist(
        self, ctx: ManagedCollisionCollectionContext, output: KJTList
    ) -> LazyAwaitable[KeyedJaggedTensor]:
        """Slots back to the ranks the ids came from, with every owner's evictions (one all-to-all)."""
        slots = output[0].values()
        payload = self._eviction_payload()
        world = self._env.world_size
        sizes = [payload.numel()]
        if world > 1:
            gathered = [torch.zeros(1, dtype=torch.int64, device=slots.device) for _ in range(world)]
            size = torch.tensor([payload.numel()], device=slots.device)
            dist.all_gather(gathered, size, group=self._env.process_group)
            sizes = [int(g) for g in gathered]
        back = ctx.recv_counts.sum(1).tolist()
        mine = ctx.send_counts.sum(1).tolist()
        pieces = slots.split(back)
        send = torch.cat([p for piece in pieces for p in (piece, payload)])
        received = self._all_to_all(
            send, [b + payload.numel() for b in back], [m + s for m, s in zip(mine, sizes)]
        )
        parts = received.split([x for m, s in zip(mine, sizes) for x in (m, s)])
        in_order = torch.cat(parts[0::2]) if parts else received
        remapped = torch.empty_like(in_order)
        remapped[ctx.send_order] = in_order
        ctx.evictions_per_table = self._parse_evictions(parts[1::2])
        return ManagedCollisionCollectionAwaitable(replace_values(ctx.input_features[0], remapped))

    def _parse_evictions(self, payloads: List[torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
        found: Dict[int, List[torch.Tensor]] = {}
        for payload in payloads:
            values, i = payload.tolist(), 0
            while i < len(values):
                t, n = values[i], values[i + 1]
                found.setdefault(t, []).append(payload[i + 2 : i + 2 + n])
                i += 2 + n
        return {
            c.name: (torch.sort(torch.cat(found[t]))[0] if t in found else None)
            for t, c in enumerate(self._configs)
        }

    def forward(self, features: KeyedJaggedTensor) -> LazyAwaitable[KeyedJaggedTensor]:
        ctx = self.create_context()
        out = self.compute_and_output_dist(ctx, self.input_dist(ctx, features).wait().wait())
        self._last_ctx = ctx
        return out

    def evict(self) -> Dict[str, Optional[torch.Tensor]]:
        """The evictions of the last forward, ``{table: global slots or None}`` (the same on every rank)."""
        ctx = getattr(self, "_last_ctx", None)
        return {} if ctx is None else dict(ctx.evictions_per_table)

    def open_slots(self) -> Dict[str, torch.Tensor]:
        """Empty slots of the buckets this rank holds, per table it holds buckets of."""
        return {t: m.open_slots() for t, m in self._managed_collision_modules.items()}

    def iteration(self, table: str) -> int:
        return int(self._iters[table])

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        return iter(())

    def check_state_dict(self, state_dict: Dict[str, Any], prefix: str) -> List[str]:
        """Problems loading ``state_dict`` (keys under ``prefix``) would raise on this rank, found
        without writing anything (``shardkit.checkpoint.load`` asks before it copies): a map of other
        buckets, a slice that does not fit this rank's rows, a slice that is not a valid map."""
        problems = []
        for name, layouts in self._layouts.items():
            base = f"{prefix}_managed_collision_modules.{name}."
            expected = int(self._global[name]._buckets_tensor)
            buckets = state_dict.get(base + "_buckets_tensor")
            if isinstance(buckets, torch.Tensor) and (buckets.numel() != 1 or int(buckets) != expected):
                saved = int(buckets.reshape(-1)[0]) if buckets.numel() else "no"
                problems.append(
                    f"managed collision table {name!r}: the state has {saved} buckets, this module "
                    f"{expected} (a map cannot be re-cut into other buckets)"
                )
                continue
            if name not in self._managed_collision_modules:
                continue
            local = self._managed_collision_modules[name]
            candidate = {}
            try:
                for buffer, layout in layouts.items():
                    scratch = getattr(local, buffer).clone()
                    if base + buffer in state_dict:
                        load_state_value(state_dict[base + buffer], [scratch], layout)
                    candidate[buffer] = scratch
            except ValueError as err:
                problems.append(str(err))
                continue
            problem = local.map_problem(
                candidate["_mch_sorted_raw_ids"], candidate["_mch_remapped_ids_mapping"], expected
            )
            if problem is not None:
                problems.append(problem)
            iteration = state_dict.get(base + "_current_iter_tensor", self._iters[name])
            for bucket in range(local.buckets()):
                key = base + local.window_key(bucket)
                if key in state_dict:
                    problem = local.window_problem(bucket, state_dict[key], int(iteration.reshape(-1)[0]))
                    problems += [] if problem is None else [problem]
        return problems

    @property
    def unsharded_module_type(self) -> Type[ManagedCollisionCollection]:
        return ManagedCollisionCollection


def _sliced_buffers(module: MCHManagedCollisionModule) -> Dict[str, torch.Tensor]:
    """The ``[zch_size]`` state buffers, by name."""
    return {n: b for n, b in module.named_buffers(recurse=False) if n not in _REPLICATED_BUFFERS}


def _ids_kjt(ids: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        ["ids"], ids, lengths=torch.tensor([ids.numel()], device=ids.device), validate=False
    )


def _maps_to_state_dict(
    module: ShardedManagedCollisionCollection, state_dict, prefix: str, local_metadata
) -> None:
    for key in [k for k in state_dict if k.startswith(f"{prefix}_managed_collision_modules.")]:
        del state_dict[key]
    for name, layouts in module._layouts.items():
        base = f"{prefix}_managed_collision_modules.{name}."
        local = module._managed_collision_modules[name] if name in module._managed_collision_modules else None
        for buffer, layout in layouts.items():
            shards = [] if local is None else [getattr(local, buffer)]
            state_dict[base + buffer] = to_state_value(shards, layout, torch.int64)
        state_dict[base + "_current_iter_tensor"] = module._iters[name]
        # a copy: loading (dcp.load in place, then load_state_dict) compares it with this module's
        state_dict[base + "_buckets_tensor"] = module._global[name]._buckets_tensor.clone()
        # the eviction windows of the buckets this rank holds, one record per (global) bucket: any
        # world size reads the buckets it holds
        for bucket in range(0 if local is None else local.buckets()):
            state_dict[base + local.window_key(bucket)] = local.window_state(bucket)


def _maps_from_state_dict(
    module: ShardedManagedCollisionCollection,
    state_dict,
    prefix: str,
    local_metadata,
    strict: bool,
    missing_keys: List[str],
    unexpected_keys: List[str],
    error_msgs: List[str],
) -> None:
    for name, layouts in module._layouts.items():
        base = f"{prefix}_managed_collision_modules.{name}."
        local = module._managed_collision_modules[name] if name in module._managed_collision_modules else None
        buckets = state_dict.pop(base + "_buckets_tensor", None)
        expected = module._global[name]._buckets_tensor
        if buckets is not None and int(buckets) != int(expected):
            error_msgs.append(
                f"managed collision table {name!r}: the state has {int(buckets)} buckets, this module "
                f"{int(expected)} (a map cannot be re-cut into other buckets)"
            )
            continue
        iteration = state_dict.pop(base + "_current_iter_tensor", None)
        if iteration is not None:
            with torch.no_grad():
                module._iters[name].copy_(iteration)
        # windows of buckets held elsewhere (a whole map's state dict): not this rank's to load; the
        # local module's own hook takes those of its buckets
        held = set() if local is None else {local.window_key(b) for b in range(local.buckets())}
        for key in [k for k in state_dict if k.startswith(base + WINDOW_KEY)]:
            if key[len(base) :] not in held:
                del state_dict[key]
        for buffer, layout in layouts.items():
            key = base + buffer
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            try:
                load_state_value(
                    state_dict.pop(key), [] if local is None else [getattr(local, buffer)], layout
                )
            except ValueError as err:
                error_msgs.append(str(err))
        if local is not None:
            # the local module's own keys map to its buffers (nothing copied); its post-hook validates
            for buffer, value in local.named_buffers(prefix=base[:-1], recurse=False):
                state_dict[buffer] = value


class ManagedCollisionCollectionSharder(ModuleSharder[ManagedCollisionCollection]):
    """Shards a ManagedCollisionCollection with the plan of its tables (ROW_WISE, TABLE_WISE, COLUMN_WISE)."""

    @property
    def module_type(self) -> Type[ManagedCollisionCollection]:
        return ManagedCollisionCollection

    def shard(
        self,
        module: ManagedCollisionCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        sharding_type_to_sharding: Optional[dict] = None,
        device: Optional[torch.device] = None,
    ) -> ShardedManagedCollisionCollection:
        return ShardedManagedCollisionCollection(
            module, params, env, device, sharding_type_to_sharding, self.qcomm_codecs_registry
        )

    def shardable_parameters(self, module: ManagedCollisionCollection) -> Dict[str, torch.Tensor]:
        return {}

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(MC_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]


def create_mc_sharding(sharding_type: str, sharding_infos: list, env: ShardingEnv, device=None) -> str:
    """The specification's factory of an MC sharding. shardkit routes each table by its plan inside
    ``ShardedManagedCollisionCollection``; this returns the sharding type after checking it is supported."""
    if sharding_type not in MC_SHARDING_TYPES:
        raise ValueError(f"managed collision tables support {MC_SHARDING_TYPES}, not {sharding_type!r}")
    return sharding_type


__all__ = [
    "ManagedCollisionCollectionAwaitable",
    "ManagedCollisionCollectionContext",
    "ManagedCollisionCollectionSharder",
    "ShardedManagedCollisionCollection",
    "create_mc_sharding",
]
