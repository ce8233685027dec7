"""The backing file of an offloaded shard: layout, header checks, directory checks, residency, clean-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardkit.kernels.offload import OffloadSpec
from shardkit.kernels.offload.backing_store import (
    HEADER_BYTES,
    OFFLOAD_DIR_ENV,
    RESIDENT_MAP_ENV,
    BackingStore,
    bytes_needed,
    check_directory,
    default_offload_dir,
    field_specs,
    read_header,
    resident_map_allowance,
)

FIELDS = field_specs((1000, 16), torch.float16, {"sum": (1000,)})
IDENTITY = {"tables": [["t", 0, 1000, 0, 16]], "rank": 0}


def _resident_kib(path: str) -> int:
    """Resident KiB of this process's mapping of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_fields_are_file_backed_tensors(tmp_path):
    store = BackingStore.create(FIELDS, IDENTITY, str(tmp_path), "t")
    weight, state = store.tensors["weight"], store.tensors["state.sum"]
    assert weight.shape == (1000, 16) and weight.dtype == torch.float16
    assert state.shape == (1000,) and state.dtype == torch.float32
    assert torch.count_nonzero(weight) == 0 and torch.count_nonzero(state) == 0
    assert os.path.getsize(store.path) == bytes_needed(FIELDS) >= HEADER_BYTES + 1000 * 16 * 2 + 1000 * 4
    weight[7] = 1.5
    state[3] = 2.0
    store.flush()
    # another mapping of the same file sees the writes: they are in the file, not in process memory
    again = BackingStore.open(store.path, FIELDS, IDENTITY)
    assert torch.equal(again.tensors["weight"][7], torch.full((16,), 1.5, dtype=torch.float16))
    assert again.tensors["state.sum"][3] == 2.0
    assert read_header(store.path)["identity"] == IDENTITY


def test_drop_resident_unmaps_pages_and_keeps_data(tmp_path):
    fields = field_specs((4096, 64), torch.float32, {})
    store = BackingStore.create(fields, IDENTITY, str(tmp_path), "big")
    store.tensors["weight"].fill_(3.0)
    assert _resident_kib(store.path) >= 4096 * 64 * 4 // 1024  # every page touched
    store.drop_resident()
    assert _resident_kib(store.path) == 0
    assert torch.all(store.tensors["weight"] == 3.0)  # read back from the page cache / file


def test_keep_mapped_within_the_allowance_keeps_pages_mapped(tmp_path, monkeypatch):
    fields = field_specs((4096, 64), torch.float32, {})  # 1 MiB of weights + the header
    monkeypatch.setenv(RESIDENT_MAP_ENV, "3M")  # room for two such files, not three
    stores = [BackingStore.create(fields, IDENTITY, str(tmp_path), f"t{i}") for i in range(3)]
    assert [s.keep_mapped() for s in stores] == [True, True, False]
    assert stores[0].keep_mapped()  # asking again claims nothing more
    for store in stores:
        store.tensors["weight"].fill_(2.0)
        store.drop_resident()
    assert _resident_kib(stores[0].path) >= 4096 * 64 * 4 // 1024  # kept: every page still mapped
    assert _resident_kib(stores[2].path) == 0  # beyond the allowance: unmapped as before
    assert all(torch.all(s.tensors["weight"] == 2.0) for s in stores)
    # a store that goes away gives its share back
    path = stores[0].path
    del stores[0]
    assert not os.path.exists(path)
    assert stores[1].keep_mapped() and stores[-1].keep_mapped()


def test_keep_mapped_is_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(RESIDENT_MAP_ENV, raising=False)
    store = BackingStore.create(FIELDS, IDENTITY, str(tmp_path), "t")
    assert resident_map_allowance() == 0 and not store.keep_mapped() and not store.resident
    assert not BackingStore.in_host_memory(FIELDS).keep_mapped()  # no file, nothing to keep mapped


@pytest.mark.parametrize(
    "value, expected", [("off", 0), ("0", 0), ("4096", 4096), ("2k", 2048), ("1G", 1 << 30)]
)
def test_resident_map_allowance_parses_bytes(monkeypatch, value, expected):
    monkeypatch.setenv(RESIDENT_MAP_ENV, value)
    assert resident_map_allowance() == expected


@pytest.mark.parametrize("value", ["lots", "-5", "1.5G", "12Q"])
def test_resident_map_allowance_rejects_bad_values(monkeypatch, value):
    monkeypatch.setenv(RESIDENT_MAP_ENV, value)
    with pytest.raises(ValueError, match=RESIDENT_MAP_ENV):
        resident_map_allowance()


@pytest.mark.parametrize(
    "identity, fields, what",
    [
        ({"tables": [["other", 0, 1000, 0, 16]], "rank": 0}, FIELDS, "identity"),
        (IDENTITY, field_specs((1000, 16), torch.float32, {"sum": (1000,)}), "fields"),
        (IDENTITY, field_specs((999, 16), torch.float16, {"sum": (999,)}), "fields"),
    ],
)
def test_open_refuses_another_table_shape_or_dtype(tmp_path, identity, fields, what):
    store = BackingStore.create(FIELDS, IDENTITY, str(tmp_path), "t")
    with pytest.raises(ValueError, match=what):
        BackingStore.open(store.path, fields, identity)


def test_open_refuses_damaged_files(tmp_path):
    store = BackingStore.create(FIELDS, IDENTITY, str(tmp_path), "t")
    with open(store.path, "r+b") as f:  # truncated
        f.truncate(os.path.getsize(store.path) - 100)
    with pytest.raises(ValueError, match="damaged"):
        BackingStore.open(store.path, FIELDS, IDENTITY)
    junk = tmp_path / "junk.skoff"
    junk.write_bytes(b"not a backing file" * 300)
    with pytest.raises(ValueError, match="bad magic"):
        BackingStore.open(str(junk), FIELDS, IDENTITY)
    corrupt = BackingStore.create(FIELDS, IDENTITY, str(tmp_path), "t")
    with open(corrupt.path, "r+b") as f:
        f.seek(12)
        f.write(b"\xff\xfe{{")
    with pytest.raises(ValueError, match="damaged header"):
        BackingStore.open(corrupt.path, FIELDS, IDENTITY)


def test_directory_errors_name_the_path_and_bytes(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(OSError, match=f"{missing!r} does not exist.*123 bytes"):
        check_directory(missing, 123)
    with pytest.raises(OSError, match="does not exist"):
        BackingStore.create(FIELDS, IDENTITY, missing)
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        if os.access(str(readonly), os.W_OK):
            pytest.skip("running as a user that can write a read-only directory (root)")
        with pytest.raises(OSError, match="not writable"):
            BackingStore.create(FIELDS, IDENTITY, str(readonly))
    finally:
        readonly.chmod(0o700)
    free = os.statvfs(str(tmp_path)).f_bavail * os.statvfs(str(tmp_path)).f_frsize
    with pytest.raises(OSError, match=f"bytes free, the offloaded tables need {free * 2}"):
        check_directory(str(tmp_path), free * 2)
    assert list(tmp_path.glob("*.skoff")) == []  # nothing half-created


def test_files_are_exclusive_and_removed(tmp_path):
    a = BackingStore.create(FIELDS, IDENTITY, str(tmp_path), "t")
    b = BackingStore.create(FIELDS, IDENTITY, str(tmp_path), "t")
    assert a.path != b.path
    a.tensors["weight"][0] = 1
    a.close()
    assert not os.path.exists(a.path) and os.path.exists(b.path)
    assert a.tensors["weight"][0, 0] == 1  # the mapping outlives the file: no dangling tensor


def test_default_directory_is_removed_at_exit(tmp_path):
    code = (
        "import torch, os, sys\n"
        "from shardkit.kernels.offload.backing_store import BackingStore, field_specs, default_offload_dir\n"
        "s = BackingStore.create(field_specs((10, 4), torch.float32, {}), {}, None, 't')\n"
        "print(default_offload_dir()); print(s.path)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != OFFLOAD_DIR_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    directory, path = out.stdout.split()
    assert path.startswith(directory)
    assert not os.path.exists(directory) and not os.path.exists(path)


def test_environment_variable_chooses_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(OFFLOAD_DIR_ENV, str(tmp_path))
    assert default_offload_dir() == str(tmp_path)
    store = BackingStore.create(FIELDS, IDENTITY, None, "t")
    assert os.path.dirname(store.path) == str(tmp_path)


def test_offload_spec_validation():
    assert OffloadSpec("caching", 0.01).cache_rows(50) == 1
    assert OffloadSpec("caching", 0.2).cache_rows(1000) == 200
    assert OffloadSpec("uvm").cache_rows(1000) == 0
    with pytest.raises(ValueError, match="load factor"):
        OffloadSpec("caching", 0.0)
    with pytest.raises(ValueError, match="algorithm"):
        OffloadSpec("caching", 0.5, "fifo")
    with pytest.raises(ValueError, match="kind"):
        OffloadSpec("ssd")
