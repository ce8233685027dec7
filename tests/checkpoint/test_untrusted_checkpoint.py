"""Crafted checkpoints: no code runs, no unbounded work, symlinks, and raw dcp.load with shardkit's
reader. One process (no process group): ``save`` / ``load`` and ``dcp.load`` work without one.

Each crafted checkpoint recomputes the manifest's checksums, as an attacker who can write the
directory would, so only the content checks stand between it and the model.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex

from shardkit import checkpoint
from shardkit.checkpoint import CheckpointError, VerifiedFileSystemReader
from shardkit.checkpoint.manifest import file_digest


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model_and_adam(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 1))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    adam.step()
    return model, adam


def _state(model: nn.Module, adam: torch.optim.Optimizer) -> dict:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in adam.state.items():
        out.update({f"adam.{names[id(p)]}.{k}": v.clone() for k, v in s.items()})
    out["adam.lr"] = adam.param_groups[0]["lr"]
    return out


def _assert_state(model, adam, expected: dict) -> None:
    got = _state(model, adam)
    assert set(got) == set(expected)
    for key, value in expected.items():
        same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
        assert same, f"{key} differs"


def _read_metadata(directory: str):
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own, trusted, file


def _rewrite(directory: str, metadata) -> None:
    """Write ``metadata`` and recompute every checksum of the manifest (what an attacker would do)."""
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    manifest_path = os.path.join(directory, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"] = {
        n: file_digest(os.path.join(directory, n)) for n in os.listdir(directory) if n != "manifest.json"
    }
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of a trained model and its Adam optimizer; the state it holds."""
    model, adam = _model_and_adam(0)
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, model, adam)
    return path, _state(model, adam)


def _payload(kind: str, marker: str) -> bytes:
    if kind == "pickle":
        return pickle.dumps(_Evil(marker))
    buffer = io.BytesIO()
    torch.save({"lr": _Evil(marker)}, buffer)  # torch's zip format, the object inside
    return buffer.getvalue()


def _replace_lr_record(directory: str, payload: bytes) -> str:
    """Point the optimizer's ``lr`` record (a non-tensor, bytes record) at ``payload``, appended to
    its data file; returns the record's key."""
    metadata = _read_metadata(directory)
    fqn = next(
        k
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, BytesStorageMetadata) and k.endswith(".lr")
    )
    info = metadata.storage_data[MetadataIndex(fqn)]
    data_file = os.path.join(directory, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(payload)
    info.offset, info.length = offset, len(payload)
    _rewrite(directory, metadata)
    return fqn


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_a_crafted_record_runs_no_code(saved, tmp_path, kind):
    path, _ = saved
    marker = str(tmp_path / "code-ran")
    fqn = _replace_lr_record(path, _payload(kind, marker))
    model, adam = _model_and_adam(1)
    before = _state(model, adam)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path, model, adam)
    assert not os.path.exists(marker), "loading the checkpoint ran the record's code"
    assert f"refusing to load the record '{fqn}'" in str(info.value)
    refused = "GLOBAL posix.system" if kind == "torch.save" else "Unsupported operand"  # pickle's FRAME
    assert refused in str(info.value) and "weights_only` set to `False`" not in str(info.value)
    _assert_state(model, adam, before)
    # raw dcp with shardkit's reader: dcp's own error on the same grounds, no code
    state = {"model": model.state_dict(), "optim": {"param_groups": [{"lr": 0.0}]}}
    with pytest.raises(BaseException) as info:
        dcp.load(state, storage_reader=VerifiedFileSystemReader(path))
    assert not os.path.exists(marker), "dcp.load with VerifiedFileSystemReader ran the record's code"
    assert "refusing to load the record" in str(info.value)


def _first_tensor(metadata) -> str:
    return next(
        k for k, v in metadata.state_dict_metadata.items() if k.startswith("model.") and k.endswith("weight")
    )


@pytest.mark.parametrize(
    "craft, message",
    [
        # the fault suite's file: one chunk repeated 40,000 times per tensor (a few hundred KB)
        (lambda chunks: chunks * 40_000, "describe more than its"),
        (lambda chunks: [], "cover 0 of its"),
        (lambda chunks: [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([5, 6]))], "outside the tensor"),
        (lambda chunks: [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))], "outside the tensor"),
        # same volume as the tensor, but two halves overlapping by a row and a row never saved
        (
            lambda chunks: [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
                ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 6])),
            ],
            "overlap",
        ),
        (
            lambda chunks: [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([0, 0]))] * 70_000,
            "70000 chunks",
        ),
    ],
    ids=["repeated", "none", "outside", "wrong-rank", "overlapping", "too-many"],
)
def test_metadata_describing_more_than_the_model_fails_fast(saved, craft, message):
    path, _ = saved
    metadata = _read_metadata(path)
    fqn = _first_tensor(metadata)
    entry = metadata.state_dict_metadata[fqn]
    assert tuple(entry.size) == (4, 6)
    entry.chunks = craft(entry.chunks)
    _rewrite(path, metadata)
    model, adam = _model_and_adam(1)
    before = _state(model, adam)
    with pytest.raises(CheckpointError, match=f"tensor '{fqn}'.*{message}"):
        checkpoint.load(path, model, adam)
    _assert_state(model, adam, before)
    state = {"model": model.state_dict()}
    with pytest.raises(BaseException, match=f"tensor '{fqn}'.*{message}"):
        dcp.load(state, storage_reader=VerifiedFileSystemReader(path))


def test_storage_entries_stay_inside_the_listed_files(saved):
    path, _ = saved
    metadata = _read_metadata(path)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "manifest.json"  # a file of the directory, not a data file
    _rewrite(path, metadata)
    model, adam = _model_and_adam(1)
    with pytest.raises(CheckpointError, match="a file the manifest does not list"):
        checkpoint.load(path, model, adam)
    metadata = _read_metadata(path)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../elsewhere.distcp"
    _rewrite(path, metadata)
    with pytest.raises(CheckpointError, match="not a plain slice of a checkpoint file"):
        checkpoint.load(path, model, adam)
    metadata = _read_metadata(path)
    index = next(iter(metadata.storage_data))
    del metadata.storage_data[index]
    _rewrite(path, metadata)
    missing = f"the chunk of '{index.fqn}' at offsets .* has no storage entry"
    with pytest.raises(CheckpointError, match=missing):
        checkpoint.load(path, model, adam)


def test_save_through_a_symlink_replaces_the_target(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    first, first_adam = _model_and_adam(0)
    checkpoint.save(str(link), first, first_adam)
    second, second_adam = _model_and_adam(2)
    checkpoint.save(str(link), second, second_adam)  # replaces the checkpoint the link points to
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert sorted(os.listdir(tmp_path)) == ["link", "real"], "a moved-aside or temporary directory was left"
    for where in (link, real):
        model, adam = _model_and_adam(5)
        checkpoint.load(str(where), model, adam)
        _assert_state(model, adam, _state(second, second_adam))


def test_raw_dcp_load_with_the_verified_reader(saved, tmp_path):
    path, expected = saved
    model, adam = _model_and_adam(3)
    # checkpoint.save stores {"model": model.state_dict(), "optim": ...}; load the model's part raw
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=VerifiedFileSystemReader(path))
    model.load_state_dict(state["model"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[f"model.{key}"]), key
    # a flipped byte in a data file: an error naming it, before anything is written
    bad = str(tmp_path / "flipped")
    shutil.copytree(path, bad)
    data = os.path.join(bad, next(n for n in os.listdir(bad) if n.endswith(".distcp")))
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    fresh, _ = _model_and_adam(4)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    state = {"model": fresh.state_dict()}
    with pytest.raises(BaseException, match="checksum mismatch"):
        dcp.load(state, storage_reader=VerifiedFileSystemReader(bad))
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    # a directory without a manifest (not saved by shardkit.checkpoint.save) is refused
    raw = str(tmp_path / "raw")
    dcp.save({"model": fresh.state_dict()}, checkpoint_id=raw)
    with pytest.raises(BaseException, match="manifest.json: missing"):
        dcp.load({"model": fresh.state_dict()}, storage_reader=VerifiedFileSystemReader(raw))
