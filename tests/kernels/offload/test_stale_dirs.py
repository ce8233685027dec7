"""Default offload directories of killed processes are swept by the next process; nothing else is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from shardkit.kernels.offload import stale_dirs
from shardkit.kernels.offload.backing_store import (
    OFFLOAD_DIR_ENV,
    BackingStore,
    check_directory,
    field_specs,
    stale_backing_files,
)

pytestmark = pytest.mark.skipif(
    stale_dirs.process_start_time(os.getpid()) is None, reason="needs /proc (Linux) to tell live owners"
)

_CREATE = (
    "import sys, torch\n"
    "from shardkit.kernels.offload.backing_store import BackingStore, field_specs, default_offload_dir\n"
    "s = BackingStore.create(field_specs((4096, 16), torch.float32, {}), {}, None, 't')\n"
    "print(default_offload_dir(), flush=True)\n"
)


def _env(tmp_path):
    """The environment of a child whose temporary directory is ``tmp_path`` and that names no offload dir."""
    env = {k: v for k, v in os.environ.items() if k != OFFLOAD_DIR_ENV}
    env["TMPDIR"] = str(tmp_path)
    return env


def _marked_dir(parent, name, record):
    path = parent / name
    path.mkdir()
    (path / "table-1-abc.skoff").write_bytes(b"\1" * 8192)
    stale_dirs.write_marker(str(path), record)
    return path


def test_killed_process_directory_is_removed_by_the_next_process(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _CREATE + "import time; time.sleep(600)\n"],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
    )
    try:
        stale = child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)  # no exit clean-up runs
        child.wait()
        child.stdout.close()
    assert stale.startswith(str(tmp_path)) and os.path.isdir(stale)
    assert any(name.endswith(".skoff") for name in os.listdir(stale))

    out = subprocess.run(
        [sys.executable, "-c", _CREATE], capture_output=True, text=True, env=_env(tmp_path), check=True
    )
    mine = out.stdout.strip()
    assert not os.path.exists(stale), out.stderr
    assert f"removed stale offload directory {stale} of dead process {child.pid}" in out.stderr
    freed = int(out.stderr.split(f"{stale} of dead process {child.pid} (")[1].split(" bytes freed")[0])
    assert freed >= 4096 * 16 * 4  # the backing file's reserved blocks
    assert mine != stale and not os.path.exists(mine)  # the second process cleaned its own up at exit


def test_live_owner_directory_is_untouched(tmp_path):
    live_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        other = _marked_dir(tmp_path, "shardkit-offload-a", stale_dirs.owner_record(live_child.pid))
        mine = _marked_dir(tmp_path, "shardkit-offload-b", stale_dirs.owner_record())
        assert stale_dirs.sweep_dead(str(tmp_path)) == []
        assert (other / "table-1-abc.skoff").exists() and (mine / "table-1-abc.skoff").exists()
    finally:
        live_child.kill()
        live_child.wait()
    # the same directory once its owner is gone
    assert [p for p, _ in stale_dirs.sweep_dead(str(tmp_path))] == [str(other)]
    assert not other.exists() and mine.exists()


def test_directories_without_a_valid_marker_are_untouched(tmp_path):
    dead = {**stale_dirs.owner_record(), "start_time": -1}
    unmarked = tmp_path / "shardkit-offload-nomarker"
    unmarked.mkdir()
    (unmarked / "x.skoff").write_bytes(b"data")
    garbled = tmp_path / "shardkit-offload-garbled"
    garbled.mkdir()
    (garbled / stale_dirs.MARKER).write_text("{not json")
    other_name = _marked_dir(tmp_path, "not-shardkit", dead)  # a marker, but not a default directory's name
    other_host = _marked_dir(tmp_path, "shardkit-offload-host", {**dead, "host": "elsewhere.invalid"})
    other_ns = _marked_dir(tmp_path, "shardkit-offload-ns", {**dead, "pid_namespace": "pid:[1]"})
    no_proc = _marked_dir(tmp_path, "shardkit-offload-noproc", {**dead, "boot_id": None, "start_time": None})
    target = _marked_dir(tmp_path, "real-target", dead)
    link = tmp_path / "shardkit-offload-link"
    link.symlink_to(target)  # a link is never followed nor removed
    plain_file = tmp_path / "shardkit-offload-file"
    plain_file.write_text("x")

    assert stale_dirs.sweep_dead(str(tmp_path)) == []
    for path in (unmarked, garbled, other_name, other_host, other_ns, no_proc, link, target, plain_file):
        assert os.path.lexists(path), path
    assert (unmarked / "x.skoff").read_bytes() == b"data"


def test_reused_pid_counts_as_dead(tmp_path):
    me = stale_dirs.owner_record()
    assert me["start_time"] == stale_dirs.process_start_time(os.getpid())
    reused = _marked_dir(tmp_path, "shardkit-offload-reused", {**me, "start_time": me["start_time"] + 1})
    rebooted = _marked_dir(tmp_path, "shardkit-offload-rebooted", {**me, "boot_id": "an-earlier-boot"})
    kept = _marked_dir(tmp_path, "shardkit-offload-kept", {**me, "start_time": me["start_time"] + 1})
    removed = stale_dirs.sweep_dead(str(tmp_path), keep=str(kept))
    assert sorted(p for p, _ in removed) == sorted([str(reused), str(rebooted)])
    assert all(freed >= 8192 for _, freed in removed)
    assert not reused.exists() and not rebooted.exists() and kept.exists()


def test_marker_records_pid_and_start_time(tmp_path):
    record = stale_dirs.owner_record()
    path = tmp_path / "shardkit-offload-x"
    path.mkdir()
    stale_dirs.write_marker(str(path))
    assert json.loads((path / stale_dirs.MARKER).read_text()) == record
    assert record["pid"] == os.getpid() and isinstance(record["start_time"], int)
    assert not stale_dirs.owner_is_dead(record)


def test_chosen_directory_is_never_swept_and_errors_name_stale_files(tmp_path, monkeypatch):
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    env = {**_env(tmp_path), OFFLOAD_DIR_ENV: str(chosen)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CREATE + "print(s.path, flush=True); import time; time.sleep(600)\n"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == str(chosen)
        left = child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert os.path.dirname(left) == str(chosen)

    # the next run with the same chosen directory keeps the dead run's file (it is never swept)
    subprocess.run([sys.executable, "-c", _CREATE], capture_output=True, text=True, env=env, check=True)
    assert os.path.exists(left)
    monkeypatch.setenv(OFFLOAD_DIR_ENV, str(chosen))
    live = BackingStore.create(field_specs((8, 4), torch.float32, {}), {}, None, "t")
    assert [p for p, _ in stale_backing_files(str(chosen))] == [left]  # the live run's file is not listed
    assert os.path.exists(left) and os.path.exists(live.path)

    # an error about the directory says what the dead run left and how to remove it
    with pytest.raises(OSError, match="1 backing file.*left by runs that were killed.*remove them") as err:
        check_directory(str(chosen), 1 << 62)
    assert left in str(err.value)

    # an existing file is never reused (O_EXCL): the error names it and says how to remove it
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=7))
    first = BackingStore.create(field_specs((8, 4), torch.float32, {}), {}, str(chosen), "dup")
    with pytest.raises(FileExistsError, match=f"{first.path!r} already exists.*remove it"):
        BackingStore.create(field_specs((8, 4), torch.float32, {}), {}, str(chosen), "dup")
    live.close()
    first.close()
