"""Packages: a round trip in a fresh process, and every bad package refused with a clear error.

The fresh process is a new interpreter that imports only torch and shardkit (it checks that nothing of
the tests is loaded), rebuilds the model from the package and must give the saving process's outputs
exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardkit.inference import PackageError, load_package, quantize_inference_model, save_package
from shardkit.inference.package import CONFIG_FILE, WEIGHTS_FILE
from shardkit.models import DLRM
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
)
from shardkit.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from shardkit.sparse import KeyedJaggedTensor

ROWS = {"t_user": 20, "t_item": 30}


def _dlrm(seed: int = 0, rows: int = 20) -> DLRM:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(rows, 8, name="t_user", feature_names=["user"], pooling=PoolingType.MEAN),
            EmbeddingBagConfig(30, 8, name="t_item", feature_names=["item"]),
        ]
    )
    model = DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])
    return quantize_inference_model(model, per_table_weight_dtype={"t_item": torch.quint4x2})


def _inputs():
    kjt = KeyedJaggedTensor(
        ["user", "item"], torch.tensor([1, 19, 3, 0, 29, 5, 7]), lengths=torch.tensor([2, 0, 1, 1, 2, 1])
    )
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(5)), kjt


FRESH = """
import sys
import torch
from shardkit.inference import load_package

model = load_package(sys.argv[1])
case = torch.load(sys.argv[2], weights_only=True)
from shardkit.sparse import KeyedJaggedTensor
kjt = KeyedJaggedTensor(["user", "item"], case["values"], lengths=case["lengths"])
with torch.inference_mode():
    out = model(case["dense"], kjt)
assert torch.equal(out, case["out"]), (out, case["out"])
assert not any(name == "tests" or name.startswith("tests.") for name in sys.modules)
print("same answers", type(model).__name__, type(model.sparse_arch.embedding_bag_collection).__name__)
"""


def test_round_trip_in_a_fresh_process(tmp_path):
    model = _dlrm()
    dense, kjt = _inputs()
    with torch.inference_mode():
        out = model(dense, kjt)
    save_package(model, tmp_path / "pkg")
    torch.save(
        {"dense": dense, "values": kjt.values(), "lengths": kjt.lengths(), "out": out}, tmp_path / "case.pt"
    )
    (tmp_path / "fresh.py").write_text(FRESH)
    done = subprocess.run(
        [sys.executable, "fresh.py", str(tmp_path / "pkg"), str(tmp_path / "case.pt")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "same answers DLRM QuantEmbeddingBagCollection" in done.stdout


def test_round_trip_of_the_collections(tmp_path):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(10, 4, name="t", feature_names=["f"])], is_weighted=True)
    float_ec = EmbeddingCollection([EmbeddingConfig(10, 4, name="t", feature_names=["f"])])
    ec = QuantEmbeddingCollection.from_float(float_ec, output_dtype=torch.float16)
    kjt = KeyedJaggedTensor(
        ["f"], torch.tensor([1, 2, 9]), torch.tensor([0.5, 1.0, 2.0]), lengths=torch.tensor([2, 1])
    )
    for i, module in enumerate([ebc, ec]):
        loaded = load_package(save_package(module, tmp_path / str(i)))
        assert type(loaded) is type(module)
        if i == 0:
            assert torch.equal(loaded(kjt).values(), module(kjt).values())
        else:
            assert all(torch.equal(loaded(kjt)[k].values(), module(kjt)[k].values()) for k in ["f"])
            assert loaded.output_dtype == torch.float16


def _saved(tmp_path):
    return save_package(_dlrm(), tmp_path / "pkg")


def test_truncated_weights(tmp_path):
    root = _saved(tmp_path)
    data = (root / WEIGHTS_FILE).read_bytes()
    (root / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    message = rf"{WEIGHTS_FILE} is truncated: {len(data) // 2} bytes, the package describes {len(data)}"
    with pytest.raises(PackageError, match=message):
        load_package(root)


def test_tampered_weights(tmp_path):
    root = _saved(tmp_path)
    data = bytearray((root / WEIGHTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (root / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(PackageError, match=f"{WEIGHTS_FILE} was modified: its sha256 differs"):
        load_package(root)


def test_truncated_or_tampered_description(tmp_path):
    root = _saved(tmp_path)
    text = (root / CONFIG_FILE).read_text()
    (root / CONFIG_FILE).write_text(text[: len(text) // 2])
    with pytest.raises(PackageError, match="is not valid JSON"):
        load_package(root)
    # a description edited to another table size: the weights are not those of the described model
    config = json.loads(text)
    config["model"]["embedding_bag_collection"]["tables"][0]["num_embeddings"] = 21
    (root / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(PackageError, match="the weights are not those of the described model"):
        load_package(root)
    # absurd sizes are refused from the description's shapes, before anything is allocated
    config["model"]["embedding_bag_collection"]["tables"][0]["num_embeddings"] = 10**12
    (root / CONFIG_FILE).write_text(json.dumps(config))
    message = (
        r"weights are not those of the described model: .*t_user.weight: weights \(torch.uint8, \(20, 12\)\)"
    )
    with pytest.raises(PackageError, match=message):
        load_package(root)
    with pytest.raises(PackageError, match="is not a shardkit package: it has no shardkit_package.json"):
        load_package(tmp_path)


def test_other_version(tmp_path):
    root = _saved(tmp_path)
    config = json.loads((root / CONFIG_FILE).read_text())
    config["format_version"], config["shardkit_version"] = 2, "9.0.0"
    (root / CONFIG_FILE).write_text(json.dumps(config))
    message = r"package format 2, written by shardkit '9.0.0'; this shardkit .* reads format 1"
    with pytest.raises(PackageError, match=message):
        load_package(root)


def test_other_model(tmp_path):
    root = _saved(tmp_path)
    # into a model described differently (21 rows in t_user): refused before any weight is read
    message = r"another model: model.embedding_bag_collection.tables\[0\].num_embeddings: package 20, model 2"
    with pytest.raises(PackageError, match=message):
        load_package(root, _dlrm(rows=21))
    # another package's weights file under this description
    other = save_package(_dlrm(seed=1, rows=21), tmp_path / "other")
    (root / WEIGHTS_FILE).write_bytes((other / WEIGHTS_FILE).read_bytes())
    with pytest.raises(PackageError, match="was modified|is not the one described"):
        load_package(root)
    # into a model described the same: its weights become the package's
    fresh = _dlrm(seed=3)
    loaded = load_package(save_package(_dlrm(), tmp_path / "again"), fresh)
    dense, kjt = _inputs()
    assert loaded is fresh and torch.equal(fresh(dense, kjt), _dlrm()(dense, kjt))


def test_unsupported_model_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="a package describes EmbeddingBagCollection, .*got Linear"):
        save_package(torch.nn.Linear(2, 2), tmp_path)


@pytest.mark.parametrize("quantized", [True, False], ids=["int8", "fp32"])
def test_round_trip_of_the_demo_model(tmp_path, quantized):
    from shardkit.datasets import TableSpec
    from shardkit.models import MixedDimDLRM

    torch.manual_seed(0)
    specs = [TableSpec("user", 20, 16), TableSpec("item", 30, 8)]  # one interacting, one wide table
    model = MixedDimDLRM(specs, 5, 16, hidden=12, activation=torch.nn.SiLU).eval()
    if quantized:
        model.ebc = QuantEmbeddingBagCollection.from_float(model.ebc, data_type=DataType.INT8)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 3, (2 * 4,), generator=gen)
    kjt = KeyedJaggedTensor(
        ["user", "item"], torch.randint(0, 20, (int(lengths.sum()),), generator=gen), lengths=lengths
    )
    dense = torch.randn(4, 5, generator=gen)
    with torch.inference_mode():
        want = model.logits(dense, kjt)
    save_package(model, tmp_path / "pkg")
    loaded = load_package(tmp_path / "pkg")
    assert type(loaded) is MixedDimDLRM and type(loaded.ebc) is type(model.ebc)
    assert type(loaded.dense_arch[1]) is torch.nn.SiLU
    with torch.inference_mode():
        assert torch.equal(loaded.logits(dense, kjt), want)
    model.mc_ebc = torch.nn.Identity()  # a model with managed-collision tables is not described
    with pytest.raises(TypeError, match="without managed-collision tables"):
        save_package(model, tmp_path / "other")
