"""torch.export / torch.fx / torch.jit.script of the collections in eval mode (docs/export.md).

Each module is exported (number of ids dynamic, validation left on) and fx-traced inside a wrapper,
and the program must equal the eager module on inputs other than the traced one: more and fewer ids,
empty bags, no ids at all; the fx graph (a leaf call) also on a zero-sample batch, another batch size
and another key order. TorchScript and fx with the collection as the root are refused with errors
naming what works instead.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import pytest
import torch
from torch.utils import _pytree as pytree

from shardkit.distributed.validation import validation_enabled
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
    PoolingType,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from shardkit.quant import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingCollection,
)
from shardkit.sparse import KeyedJaggedTensor

KEYS = ["f1", "f2", "f3"]


def _kjt(values: List[int], lengths: List[int], keys: List[str] = KEYS) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    )


EXAMPLE = _kjt([1, 2, 3, 4, 5, 6, 7], [1, 2, 0, 2, 1, 1])  # batch 2
# same keys and batch size, other ids: more ids, an empty bag per feature, no ids at all, one id
OTHERS = [
    _kjt([9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 19], [3, 0, 4, 1, 2, 1]),
    _kjt([11, 12, 13], [0, 3, 0, 0, 0, 0]),
    _kjt([], [0, 0, 0, 0, 0, 0]),
    _kjt([5], [0, 0, 1, 0, 0, 0]),
]
# what only a graph that runs the module itself (fx's leaf call) can take: zero samples, batch 3,
# keys in another order
FX_ONLY = [
    _kjt([], []),
    _kjt([1, 2, 3, 4, 5, 6], [1, 0, 2, 0, 1, 1, 0, 1, 0]),
    _kjt([3, 4, 5], [1, 0, 0, 1, 1, 0], keys=["f3", "f1", "f2"]),
]


def _bag_tables(shared_feature: bool = True) -> List[EmbeddingBagConfig]:
    # two groups (dims 8 and 4), SUM and MEAN; f1 in two tables reorders the output columns (the
    # managed-collision collection takes each feature in one table only)
    return [
        EmbeddingBagConfig(20, 8, name="a", feature_names=["f1", "f2"]),
        EmbeddingBagConfig(
            30,
            4,
            name="b",
            feature_names=["f3", "f1"] if shared_feature else ["f3"],
            pooling=PoolingType.MEAN,
        ),
    ]


def _seq_tables() -> List[EmbeddingConfig]:
    return [
        EmbeddingConfig(20, 8, name="a", feature_names=["f1", "f2"]),
        EmbeddingConfig(30, 4, name="b", feature_names=["f3"]),
    ]


def _mc(tables) -> ManagedCollisionCollection:
    modules = {
        t.name: MCHManagedCollisionModule(t.num_embeddings, None, LFU_EvictionPolicy(), 1, 100)
        for t in tables
    }
    return ManagedCollisionCollection(modules, tables)


def _trained_mc(module: torch.nn.Module) -> torch.nn.Module:
    # a few training steps fill slots, so that eval remaps known ids to slots and unknown ids elsewhere
    for kjt in [EXAMPLE, OTHERS[0]]:
        module(kjt)
    return module.eval()


def _fp_dict() -> FeatureProcessedEmbeddingBagCollection:
    module = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(_bag_tables(), is_weighted=True),
        {"f1": PositionWeightedModule(4), "f3": PositionWeightedModule(4)},
    )
    with torch.no_grad():
        for processor in module._feature_processors.values():
            processor.position_weight.uniform_(0.5, 2.0)
    return module


def _fp_collection() -> FeatureProcessedEmbeddingBagCollection:
    module = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(_bag_tables(), is_weighted=True),
        PositionWeightedModuleCollection({"f1": 4, "f2": 4}),
    )
    with torch.no_grad():
        for weight in module._feature_processors.position_weights.values():
            weight.uniform_(0.5, 2.0)
    return module


MODULES: Dict[str, Callable[[], torch.nn.Module]] = {
    "ebc": lambda: EmbeddingBagCollection(_bag_tables()),
    "ec": lambda: EmbeddingCollection(_seq_tables(), need_indices=True),
    "fp_ebc_dict": _fp_dict,
    "fp_ebc_collection": _fp_collection,
    "mc_ebc": lambda: _trained_mc(
        ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(_bag_tables(False)), _mc(_bag_tables(False)), return_remapped_features=True
        )
    ),
    "mc_ec": lambda: _trained_mc(
        ManagedCollisionEmbeddingCollection(EmbeddingCollection(_seq_tables()), _mc(_seq_tables()))
    ),
    "quant_ebc": lambda: QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(_bag_tables())),
    "quant_ec": lambda: QuantEmbeddingCollection.from_float(EmbeddingCollection(_seq_tables())),
    "quant_fp_ebc": lambda: QuantFeatureProcessedEmbeddingBagCollection.from_float(_fp_dict()),
    "quant_mc_ebc": lambda: QuantManagedCollisionEmbeddingBagCollection.from_float(MODULES["mc_ebc"]()),
    "quant_mc_ec": lambda: QuantManagedCollisionEmbeddingCollection.from_float(MODULES["mc_ec"]()),
}


class _Holder(torch.nn.Module):
    """A model around the module, as a user traces it (the module must not be fx's root)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, kjt: KeyedJaggedTensor):
        return self.module(kjt)


def _tensors(output) -> List[torch.Tensor]:
    # KeyedTensor / JaggedTensor / dicts / tuples are pytrees; keys are in the specs
    leaves, spec = pytree.tree_flatten(output)
    return [t for t in leaves if t is not None], spec


def _assert_same(got, want, what: str) -> None:
    got_leaves, got_spec = _tensors(got)
    want_leaves, want_spec = _tensors(want)
    assert got_spec == want_spec, what
    assert len(got_leaves) == len(want_leaves), what
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), what


def _export(module: torch.nn.Module, example: KeyedJaggedTensor, dynamic: bool = True):
    spec = [{0: torch.export.Dim.DYNAMIC} if dynamic else None, None, None, None]  # the values' count
    return torch.export.export(_Holder(module), (example,), dynamic_shapes={"kjt": spec}, strict=False)


@pytest.mark.parametrize("name", list(MODULES))
def test_export_equals_the_module_on_other_inputs(name):
    module = MODULES[name]().eval()
    assert validation_enabled()  # the program is exported with the host checks on (they step aside)
    program = _export(module, EXAMPLE).module()
    for i, kjt in enumerate([EXAMPLE, *OTHERS]):
        _assert_same(program(kjt), module(kjt), f"{name} input {i}")


@pytest.mark.parametrize("name", ["ebc", "ec", "fp_ebc_dict", "mc_ebc", "quant_ebc"])
def test_export_of_a_zero_sample_batch(name):
    # the batch size is static in an exported program: a zero-sample batch is exported as such
    module = MODULES[name]().eval()
    empty = _kjt([], [])
    program = _export(module, empty, dynamic=False).module()
    _assert_same(program(_kjt([], [])), module(empty), name)


@pytest.mark.parametrize("name", list(MODULES))
def test_fx_trace_equals_the_module_on_any_input(name):
    module = MODULES[name]().eval()
    traced = torch.fx.symbolic_trace(_Holder(module))
    # one leaf call to the module, nothing of its internals in the graph
    calls = [n for n in traced.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    assert len(calls) == 1 and calls[0].target.__name__ == "fx_leaf_call", traced.graph
    for i, kjt in enumerate([EXAMPLE, *OTHERS, *FX_ONLY]):
        _assert_same(traced(kjt), module(kjt), f"{name} input {i}")


def test_fx_trace_of_a_model_that_uses_the_output():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(_bag_tables())
            self.linear = torch.nn.Linear(8 + 8 + 4 + 4, 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.linear(self.ebc(kjt).values()).squeeze(1)

    model = Model().eval()
    traced = torch.fx.symbolic_trace(model)
    for kjt in [EXAMPLE, *OTHERS, *FX_ONLY]:
        assert torch.equal(traced(kjt), model(kjt))


@pytest.mark.parametrize("name", list(MODULES))
def test_fx_trace_with_the_module_as_root_names_the_alternatives(name):
    with pytest.raises(TypeError, match=r"root module.*Sequential.*torch\.export"):
        torch.fx.symbolic_trace(MODULES[name]())


@pytest.mark.parametrize("name", list(MODULES))
def test_jit_script_names_the_alternatives(name):
    module = MODULES[name]().eval()
    with pytest.raises(TypeError, match=r"torch\.jit\.script does not support.*torch\.export\.export"):
        torch.jit.script(module)
    with pytest.raises(TypeError, match=r"torch\.jit\.script does not support"):
        torch.jit.script(_Holder(module))  # also as a submodule


def test_exported_program_still_rejects_an_id_out_of_range():
    # the host check steps aside while exporting; the program's indexing op still bounds-checks
    module = EmbeddingBagCollection(_bag_tables()).eval()
    program = _export(module, EXAMPLE).module()
    with pytest.raises((IndexError, RuntimeError)):
        program(_kjt([1, 2, 300], [1, 1, 0, 1, 0, 0]))


def test_eager_forward_still_validates_ids():
    module = EmbeddingBagCollection(_bag_tables()).eval()
    with pytest.raises(IndexError, match="feature 'f2'"):
        module(_kjt([1, 2, 300], [1, 1, 1, 0, 0, 0]))


def test_exported_program_takes_kjts_with_or_without_cached_offsets():
    # the tree spec must not depend on whether offsets (or lengths) were computed before the call
    module = EmbeddingBagCollection(_bag_tables()).eval()
    fresh = lambda: _kjt([1, 2, 3, 4], [1, 1, 0, 1, 1, 0])  # noqa: E731
    program = _export(module, fresh()).module()
    cached = fresh()
    cached.offsets()
    from_offsets = KeyedJaggedTensor(KEYS, cached.values(), offsets=cached.offsets())
    want = module(fresh())
    for kjt in [fresh(), cached, from_offsets]:
        _assert_same(program(kjt), want, "offsets cached or not")


def test_fx_trace_of_the_managed_collision_collection():
    module = _mc(_bag_tables(False))
    module(EXAMPLE)
    module.eval()
    traced = torch.fx.symbolic_trace(_Holder(module))
    for kjt in [EXAMPLE, *OTHERS, *FX_ONLY]:
        _assert_same(traced(kjt), module(kjt), "managed collision collection")


@pytest.mark.parametrize("name", ["ebc", "ec"])
def test_exported_program_round_trips_through_save_and_load(name, tmp_path):
    # the KJT / KeyedTensor tree specs serialize (their contexts come back as tuples, as flattened)
    module = MODULES[name]().eval()
    exported = _export(module, EXAMPLE)
    # saved with its example KJT, the program's load would unpickle it (a full pickle: torch falls
    # back from weights_only); without it, nothing but tensors and the graph is stored
    exported.example_inputs = None
    torch.export.save(exported, tmp_path / "program.pt2")
    program = torch.export.load(tmp_path / "program.pt2").module()
    for i, kjt in enumerate([EXAMPLE, *OTHERS]):
        _assert_same(program(kjt), module(kjt), f"{name} loaded, input {i}")


def test_managed_collision_collection_refuses_script_and_fx_as_root():
    module = _mc(_bag_tables(False)).eval()
    with pytest.raises(
        TypeError, match=r"torch\.jit\.script does not support shardkit's ManagedCollisionCollection"
    ):
        torch.jit.script(module)
    with pytest.raises(TypeError, match=r"ManagedCollisionCollection as the root module"):
        torch.fx.symbolic_trace(module)
