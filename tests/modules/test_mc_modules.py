"""MCHManagedCollisionModule against the plain-Python reference, for every policy, on random streams
with repeats, new ids, ties and thresholds; and its checks, state dict and the collection."""

from __future__ import annotations

import io
import random

import pytest
import torch

from shardkit.modules import (
    DistanceLFU_EvictionPolicy,
    EmbeddingBagConfig,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
    average_threshold_filter,
)
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor
from tests.modules.mc_reference import ReferenceMCH

POLICIES = {
    "lfu": lambda decay, f: LFU_EvictionPolicy(threshold_filtering_func=f),
    "lru": lambda decay, f: LRU_EvictionPolicy(decay, threshold_filtering_func=f),
    "dlfu": lambda decay, f: DistanceLFU_EvictionPolicy(decay, threshold_filtering_func=f),
}


def make_pair(policy, zch, buckets, interval, hash_size, decay=1.0, threshold=None):
    module = MCHManagedCollisionModule(
        zch, torch.device("cpu"), POLICIES[policy](decay, threshold), interval, hash_size, buckets=buckets
    )
    return module, ReferenceMCH(zch, buckets, policy, interval, hash_size, decay, threshold)


def stream(rng: random.Random, hash_size: int, pool: int, length: int):
    """Ids drawn from a small pool (many repeats and ties) plus a few fresh ones."""
    ids = [rng.randrange(hash_size) for _ in range(pool)]
    return [
        ids[min(int(rng.expovariate(0.3)), pool - 1)] if rng.random() < 0.85 else rng.randrange(hash_size)
        for _ in range(length)
    ]


def run_and_compare(module, ref, rng, hash_size, steps, pool=25):
    for step in range(steps):
        ids = stream(rng, hash_size, pool, rng.randrange(0, 30))
        values = torch.tensor(ids, dtype=torch.int64)
        out = module({"t": JaggedTensor(values, lengths=torch.tensor([len(ids)]))})
        ref.profile(ids)
        assert out["t"].values().tolist() == ref.remap(ids), f"step {step}"
        evicted = module.evict()
        expected = ref.evict()
        assert (None if evicted is None else evicted.tolist()) == expected, f"step {step}"
    return module


def held_map(module) -> dict:
    ids = module._mch_sorted_raw_ids.tolist()
    slots = module._mch_remapped_ids_mapping.tolist()
    return {i: s for i, s in zip(ids, slots) if i != 2**63 - 1}


CASES = [
    # policy, zch, buckets, interval, hash_size, decay, threshold
    ("lfu", 6, 1, 1, 1000, 1.0, None),
    ("lfu", 12, 3, 2, 999, 1.0, None),
    ("lfu", 8, 2, 1, 2**63 - 1, 1.0, average_threshold_filter),
    ("lru", 6, 1, 1, 1000, 1.0, None),
    ("lru", 12, 3, 3, 5000, 2.0, None),
    ("lru", 9, 3, 1, 90, 1.0, average_threshold_filter),
    ("dlfu", 6, 1, 1, 1000, 1.0, None),
    ("dlfu", 12, 2, 2, 777, 2.0, None),
    ("dlfu", 16, 4, 1, 2**40, 1.0, average_threshold_filter),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-z{c[1]}-b{c[2]}-i{c[3]}" for c in CASES])
def test_remap_evict_and_state_follow_the_reference(case):
    policy, zch, buckets, interval, hash_size, decay, threshold = case
    module, ref = make_pair(policy, zch, buckets, interval, hash_size, decay, threshold)
    run_and_compare(module, ref, random.Random(hash(case) & 0xFFFF), hash_size, steps=40)
    assert held_map(module) == ref.id_to_slot()
    size = zch // buckets
    for name in module.eviction_policy.metadata_names:
        slots = module._mch_remapped_ids_mapping.tolist()
        values = dict(zip(slots, getattr(module, f"_mch_{name}").tolist()))
        field = 1 if name == "counts" else 2
        for b, slots in enumerate(ref.slots):
            for j, rec in enumerate(slots[:-1]):
                if rec[0] is not None:
                    assert values[b * size + j] == rec[field], (name, b, j)


def test_ties_keep_the_incumbent_and_prefer_the_smaller_new_id():
    module, ref = make_pair("lfu", 3, 1, 1, 100, 1.0, None)  # two usable slots
    for ids in ([5, 7], [9, 8, 9, 8], [1, 2, 2, 1, 3, 3]):
        out = module({"t": JaggedTensor(torch.tensor(ids), lengths=torch.tensor([len(ids)]))})
        ref.profile(ids)
        assert out["t"].values().tolist() == ref.remap(ids)
    # step 2: 8 and 9 (count 2) beat 5 and 7 (count 1); step 3: 1, 2, 3 tie with 8 and 9 at 2: kept
    assert sorted(held_map(module)) == [8, 9]


def test_eval_mode_only_remaps():
    module, _ = make_pair("lfu", 4, 1, 1, 100)
    module({"t": JaggedTensor(torch.tensor([3, 4]), lengths=torch.tensor([2]))})
    state = {k: _tensor(v).clone() for k, v in module.state_dict().items()}
    module.eval()
    out = module({"t": JaggedTensor(torch.tensor([3, 50]), lengths=torch.tensor([2]))})
    assert out["t"].values().tolist()[1] == 3  # 50 is unknown: the miss slot
    assert all(torch.equal(state[k], _tensor(v)) for k, v in module.state_dict().items())


def _tensor(value):
    """A state-dict value as a tensor: a bucket's eviction window is a tuple of one tensor."""
    return value[0] if isinstance(value, tuple) else value


@pytest.mark.parametrize("policy", ["lfu", "lru", "dlfu"])
def test_a_resume_between_two_evictions_continues_exactly(policy):
    # issue 23: the window of ids seen since the last eviction was not saved, so a state dict taken
    # between two evictions resumed with an empty window and diverged at the next eviction
    rng = random.Random(5)
    module, ref = make_pair(policy, 12, 3, 4, 600)
    run_and_compare(module, ref, rng, 600, steps=10)  # iteration 10: two steps into a window of 4
    assert any(module._history[b] for b in range(3))
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    fresh, _ = make_pair(policy, 12, 3, 4, 600)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    evictions = 0
    for step in range(10):
        ids = torch.tensor(stream(rng, 600, 25, 20), dtype=torch.int64)
        a = module({"t": JaggedTensor(ids, lengths=torch.tensor([len(ids)]))})["t"].values()
        b = fresh({"t": JaggedTensor(ids, lengths=torch.tensor([len(ids)]))})["t"].values()
        assert torch.equal(a, b), step
        ev_a, ev_b = module.evict(), fresh.evict()
        assert (None if ev_a is None else ev_a.tolist()) == (None if ev_b is None else ev_b.tolist()), step
        evictions += 0 if ev_a is None else ev_a.numel()
    assert evictions > 0
    for name, value in module.state_dict().items():
        assert torch.equal(_tensor(value), _tensor(fresh.state_dict()[name])), name


def test_a_window_that_does_not_fit_the_module_is_refused():
    module, _ = make_pair("lfu", 12, 3, 4, 600)
    run_and_compare(module, ReferenceMCH(12, 3, "lfu", 4, 600, 1.0, None), random.Random(2), 600, steps=2)
    state = module.state_dict()
    fresh, _ = make_pair("lfu", 12, 3, 4, 600)
    assert fresh.check_state_dict(state, "") == []
    bad = dict(state)
    window = state["_mch_window_1"][0].clone()
    bad["_mch_window_1"] = (torch.cat([window, torch.tensor([[599], [1], [2]])], dim=1),)  # not bucket 1's
    with pytest.raises(RuntimeError, match="window of bucket 1 does not hold distinct ascending ids"):
        fresh.load_state_dict(bad)
    bad["_mch_window_1"] = (torch.tensor([[210], [1], [9]]),)  # seen at iteration 9 of a state at 2
    assert "iterations outside (0, 2]" in " ".join(fresh.check_state_dict(bad, ""))


def test_state_dict_round_trip_continues_identically():
    rng = random.Random(3)
    module, ref = make_pair("dlfu", 12, 3, 1, 600)
    run_and_compare(module, ref, rng, 600, steps=10)
    fresh, _ = make_pair("dlfu", 12, 3, 1, 600)
    fresh.load_state_dict(module.state_dict())
    for step in range(10):
        ids = stream(rng, 600, 20, 15)
        a = module({"t": JaggedTensor(torch.tensor(ids), lengths=torch.tensor([len(ids)]))})["t"].values()
        b = fresh({"t": JaggedTensor(torch.tensor(ids), lengths=torch.tensor([len(ids)]))})["t"].values()
        assert torch.equal(a, b), step


def test_loading_a_map_of_other_buckets_is_an_error():
    two, _ = make_pair("lfu", 12, 2, 1, 600)
    three, _ = make_pair("lfu", 12, 3, 1, 600)
    with pytest.raises(ValueError, match="2 buckets, this module 3"):
        three.load_state_dict(two.state_dict())


def test_bad_configs_and_ids_are_clear_errors():
    with pytest.raises(ValueError, match="divisible by buckets"):
        MCHManagedCollisionModule(10, None, LFU_EvictionPolicy(), 1, 100, buckets=3)
    with pytest.raises(ValueError, match="eviction_interval"):
        MCHManagedCollisionModule(10, None, LFU_EvictionPolicy(), 0)
    module = MCHManagedCollisionModule(10, None, LFU_EvictionPolicy(), 1, 100, name="users")
    for bad in ([-1, 3], [100]):
        with pytest.raises(ValueError, match=r"'users': id -?\d+ is outside \[0, 100\)"):
            module({"t": JaggedTensor(torch.tensor(bad), lengths=torch.tensor([len(bad)]))})
    hashed = MCHManagedCollisionModule(
        10, None, LFU_EvictionPolicy(), 1, 100, input_hash_func=lambda ids, size: ids.abs() % size
    )
    out = hashed({"t": JaggedTensor(torch.tensor([-7, 2**62]), lengths=torch.tensor([2]))})
    # hashed to 7 and 4; the best new id takes the best-ranked evicted slot: the last empty ones
    assert out["t"].values().tolist() == [8, 7]


def test_open_slots_count_empty_slots_without_the_miss_slots():
    module, _ = make_pair("lru", 12, 3, 1, 300)
    assert module.open_slots().tolist() == [9]
    module({"t": JaggedTensor(torch.tensor([1, 2, 150]), lengths=torch.tensor([3]))})
    assert module.open_slots().tolist() == [6]


def test_collection_remaps_each_table_with_all_its_features_together():
    tables = [
        EmbeddingBagConfig(4, 2, name="a", feature_names=["fa1", "fa2"]),
        EmbeddingBagConfig(6, 2, name="b", feature_names=["fb"]),
    ]
    modules = {
        "a": MCHManagedCollisionModule(4, None, LFU_EvictionPolicy(), 1, 1000),
        "b": MCHManagedCollisionModule(6, None, LRU_EvictionPolicy(), 1, 1000, buckets=2),
    }
    mcc = ManagedCollisionCollection(modules, tables)
    kjt = KeyedJaggedTensor(
        ["fb", "fa2", "fa1"], torch.tensor([900, 10, 11, 12, 10]), lengths=torch.tensor([1, 0, 1, 1, 1, 1])
    )
    out = mcc(kjt)
    assert out.keys() == ["fa1", "fa2", "fb"]
    ref_a, ref_b = ReferenceMCH(4, 1, "lfu", 1, 1000), ReferenceMCH(6, 2, "lru", 1, 1000)
    ref_a.profile([12, 10, 10, 11])
    ref_b.profile([900])
    assert out.values().tolist() == ref_a.remap([12, 10, 10, 11]) + ref_b.remap([900])
    assert out.lengths().tolist() == [1, 1, 1, 1, 1, 0]
    assert set(mcc.evict()) == {"a", "b"}
    with pytest.raises(ValueError, match="has 5 slots, the table 6 rows"):
        ManagedCollisionCollection(
            {"a": modules["a"], "b": MCHManagedCollisionModule(5, None, LFU_EvictionPolicy(), 1)}, tables
        )
    with pytest.raises(KeyError, match="lacks managed collision feature"):
        mcc(KeyedJaggedTensor(["fa1"], torch.tensor([1]), lengths=torch.tensor([1])))
