"""``save`` and ``load``: DCP checkpoints that are whole or absent, verified before use.

Save (every rank calls it with the same directory):

1. each rank builds its state dict; a failure on any rank is an error on every rank;
2. rank 0 creates a temporary sibling directory ``.<name>.tmp-<token>``; every rank checks it sees it
   (the directory must be on a file system every rank shares);
3. ``torch.distributed.checkpoint.save`` writes DCP's files there;
4. the ranks hash the files (each a share), rank 0 writes ``manifest.json`` (checksums, world size,
   plan, versions) and only then puts the directory in place: the old checkpoint, if any, is moved
   aside, the new one renamed to ``<name>``, the old one deleted.

A crash before step 4's renames leaves the previous checkpoint untouched (and a temporary directory
that the next save to the same place removes). A crash between the two renames leaves the previous
checkpoint under ``.<name>.old-<token>``: ``load`` says so, and the next ``save`` puts it back first.

Load: the manifest and every file's size and checksum are verified first (each rank a share of the
files; any problem is an error on every rank naming the files), ``.metadata`` is read without
unpickling arbitrary objects (``safe_metadata``) and must describe no more than an exact tiling of
each tensor by a bounded number of chunks inside the listed files (``metadata_bounds``), non-tensor
records are read with torch's weights-only loader (``safe_records``: no code runs), ``dcp.load``
fills *staging copies* of the state, and the model and optimizers are written only when every rank
has read everything. A failed load leaves them as they were.

Both follow a symbolic link ``path`` (the checkpoint replaces the directory it points to; the link
stays), and turn a collective timeout (a rank stalled inside them) into a ``CheckpointError`` naming
the ranks that do not answer a roll call (``shardkit.distributed.timeouts``).

Only the default process group is supported (the state values name global ranks). Memory: a load
holds a second copy of this rank's state while staging.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
import warnings
from typing import Any, Callable, List, Optional, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

from shardkit.checkpoint.manifest import (
    MANIFEST_FILE,
    CheckpointError,
    build_manifest,
    file_digest,
    fsync_directory,
    my_share,
    read_manifest,
    verify_files,
    write_manifest,
)
from shardkit.checkpoint.metadata_bounds import check_storage_files
from shardkit.checkpoint.safe_metadata import METADATA_FILE, SafeFileSystemReader, read_metadata_file
from shardkit.checkpoint.state import (
    apply_state,
    check_state,
    checkpoint_state,
    fill_from_metadata,
    set_aside_absent_records,
    staging_copy,
)
from shardkit.distributed.agreement import gather_objects, group_rank, group_size
from shardkit.distributed.timeouts import ENV_VAR, is_peer_closed, is_timeout, roll_call
from shardkit.kernels.offload.backing_store import store_of
from shardkit.sharding.types import ShardingPlan

T = TypeVar("T")
# one line per problem in an error; more are counted, not quoted
_MAX_LINES = 8


def _agreed(step: Callable[[], T], what: str) -> T:
    """Run ``step`` on this rank; if it raised on any rank, raise ``CheckpointError`` on every rank
    naming each failing rank's error. Every exception type counts: one rank raising alone would leave
    the others waiting in the next collective."""
    result: Optional[T] = None
    error: Optional[str] = None
    try:
        result = step()
    except Exception as err:  # noqa: BLE001 - see the docstring
        error = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    errors = gather_objects(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        lines = [f"rank {r}: {e[:2000]}" for r, e in failed[:_MAX_LINES]]
        if len(failed) > _MAX_LINES:
            lines.append(f"... and {len(failed) - _MAX_LINES} more ranks")
        raise CheckpointError(f"{what} failed:\n" + "\n".join(lines))
    return result  # type: ignore[return-value]


class _ExactLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner without its guess that a checkpoint holding more keys than asked for was
    written by torch <= 2.3 (it then re-flattens the request the old way and asks for keys that do
    not exist): every key asked for must be in the checkpoint, extra keys are left unread."""

    def create_local_plan(self):
        return create_default_local_load_plan(self.state_dict, self.metadata, True)

    def commit_tensor(self, read_item, tensor) -> None:
        # a piece of an offloaded table was read into its scratch file: unmap those pages again, so
        # that the resident set grows by about one piece, not the table (they stay in the page cache)
        super().commit_tensor(read_item, tensor)
        store = store_of(tensor)
        if store is not None:
            store.drop_resident()


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's save planner that unmaps the pages of an offloaded table's backing file that writing the
    previous piece mapped into this process (they stay in the page cache): DCP writes one piece at a
    time, so the process's resident memory grows by one piece (docs/checkpoint.md), not the table."""

    _last = None

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        self.release()
        self._last = store_of(data) if isinstance(data, torch.Tensor) else None
        return data

    def release(self) -> None:
        if self._last is not None:
            self._last.drop_resident()
            self._last = None


@contextlib.contextmanager
def _quiet_dcp():
    # dcp touches ShardedTensor attributes through their deprecated path and warns from inside torch
    # on every save and load (docs/sharded_state.md); shardkit's own use of them is deliberate
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield


def _timed_out(err: BaseException) -> str:
    """``"timeout"`` when ``err``, its causes, or (dcp's ``CheckpointException``) a rank's failure in
    it is a collective or store wait that timed out; ``"cut off"`` when it is gloo's report of a peer
    that closed its connections (a peer whose own wait timed out first does); else ``""``."""
    seen = set()
    todo = [err]
    found = ""
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if is_timeout(e):
            return "timeout"
        if is_peer_closed(e):
            found = "cut off"
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [f for f in e.failures.values() if isinstance(f, BaseException)]
    return found


@contextlib.contextmanager
def _naming_silent_ranks(what: str, path: str):
    """A timeout inside the block (a rank stalled inside reading or writing, so the others' next
    collective timed out), or a peer closing its connections after its own timeout, becomes a
    ``CheckpointError`` naming the ranks that do not answer a roll call
    (``shardkit.distributed.timeouts.roll_call``); other errors pass unchanged."""
    try:
        yield
    except (Exception, CheckpointException) as err:
        how = _timed_out(err)
        if not how:
            raise
        # a survivor cut off by a peer that timed out first holds the roll call too
        # (shardkit.distributed.timeouts.naming_silent_ranks); one cut off by a rank that left with
        # its own error raises its error unchanged
        call = roll_call(stop_when_one_left=how == "cut off")
        if how == "cut off" and call.left:
            raise
        silent = call.silent
        who = f"rank(s) {silent} did not answer" if silent else "every rank answered a roll call afterwards"
        event = "a collective timed out" if how == "timeout" else "a peer closed its connections"
        raise CheckpointError(
            f"{what} {path} failed on rank {group_rank(None)}: {event} ({who}; a rank stalled "
            f"inside the checkpoint's reads or writes, or died); the timeout is set by "
            f"init_process_group(timeout=...) or {ENV_VAR}. torch said: {str(err)[:500]}"
        ) from err


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    return gather_objects(value)[0]


def _siblings(path: str, kind: str) -> List[str]:
    parent, base = os.path.split(path)
    return sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.{kind}-*")))


def _plan_summary(model: nn.Module) -> Any:
    """The model's sharding plan as JSON (``DistributedModelParallel.plan``), or None."""
    plan = getattr(model, "plan", None)
    if not isinstance(plan, ShardingPlan):
        return None
    out = {}
    for path, module_plan in plan.plan.items():
        if isinstance(module_plan, dict):
            out[path] = {
                name: {k: getattr(ps, k, None) for k in ("sharding_type", "compute_kernel", "ranks")}
                for name, ps in module_plan.items()
            }
        else:
            out[path] = str(module_plan)
    return out


def _prepare_directory(path: str) -> str:
    """Rank 0: check ``path`` may be (over)written, restore an interrupted swap, remove stale temporary
    directories, create and return a new temporary sibling."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise CheckpointError(f"{path}: the parent directory {parent} does not exist")
    old = _siblings(path, "old")
    if not os.path.exists(path) and len(old) == 1:
        os.rename(old[0], path)  # a save died between its two renames: put the previous one back
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: exists and is not a directory")
        if os.listdir(path) and not os.path.isfile(os.path.join(path, MANIFEST_FILE)):
            raise CheckpointError(
                f"{path}: a non-empty directory that is not a shardkit checkpoint; refusing to replace it"
            )
    for stale in _siblings(path, "tmp") + _siblings(path, "old"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    return tmp


def _swap_into_place(tmp: str, path: str) -> None:
    """Rank 0: the complete checkpoint in ``tmp`` becomes ``path``; the previous one is deleted."""
    aside = None
    if os.path.exists(path):
        aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:12]}")
        os.rename(path, aside)
    os.rename(tmp, path)
    fsync_directory(os.path.dirname(path))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def save(path: str | os.PathLike, model: nn.Module, optimizers: Any = None) -> None:
    """Save ``model`` (and ``optimizers``) to directory ``path``, atomically; a collective.

    Args:
        path: the checkpoint directory, on a file system every rank sees. It may not exist yet, be
            empty, or hold a previous shardkit checkpoint (replaced only once the new one is complete).
        model: any module; sharded modules save their shards (``DistributedModelParallel`` too).
        optimizers: None, one optimizer, or a mapping ``name -> optimizer`` (torch optimizers, shardkit's
            fused optimizers, ``CombinedOptimizer``).

    Raises ``CheckpointError`` on every rank if any rank fails; the previous checkpoint at ``path``
    stays intact. A rank that stalls makes the others fail at the process group's timeout with a
    ``CheckpointError`` naming it. A symbolic link ``path`` is followed: the checkpoint replaces the
    directory it points to and the link stays.
    """
    path = os.path.realpath(os.fspath(path))
    with _naming_silent_ranks("saving checkpoint", path):
        _save(path, model, optimizers)


def _save(path: str, model: nn.Module, optimizers: Any) -> None:
    rank, world = group_rank(None), group_size(None)
    state, _ = _agreed(lambda: checkpoint_state(model, optimizers), "collecting the state to checkpoint")
    tmp = _broadcast(_agreed(lambda: _prepare_directory(path) if rank == 0 else None, f"preparing {path}"))

    def _visible() -> None:
        if not os.path.isdir(tmp):
            raise CheckpointError(f"{tmp} is not visible here: checkpoint to a directory every rank shares")

    _agreed(_visible, "checking the temporary directory")
    planner = _StreamingSavePlanner()
    try:
        with _quiet_dcp():
            dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), planner=planner)
    # dcp raises CheckpointException (a BaseException) on every rank when a rank failed
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"writing checkpoint {path} failed: {str(err)[:4000]}") from err
    finally:
        planner.release()
    names = _agreed(lambda: sorted(os.listdir(tmp)), f"listing {tmp}")
    digests = _agreed(
        lambda: {n: file_digest(os.path.join(tmp, n)) for n in my_share(names, rank, world)}, "hashing"
    )
    files = {name: d for part in gather_objects(digests) for name, d in part.items()}

    def _finish() -> None:
        if rank == 0:
            write_manifest(tmp, build_manifest(files, world, _plan_summary(model)))
            _swap_into_place(tmp, path)

    _agreed(_finish, f"putting checkpoint {path} in place")


def _verify(path: str, rank: int, world: int) -> dict:
    if not os.path.exists(path):
        old = _siblings(path, "old")
        if old:
            raise CheckpointError(
                f"{path}: missing, but a save to it was interrupted; the previous checkpoint is at {old[0]} "
                "(the next save to the same path restores it; or rename it back)"
            )
    manifest = read_manifest(path)
    if METADATA_FILE not in manifest["files"]:
        raise CheckpointError(f"{os.path.join(path, MANIFEST_FILE)}: lists no {METADATA_FILE}")
    problems = verify_files(path, manifest["files"], my_share(list(manifest["files"]), rank, world))
    if problems:
        more = f"\n... and {len(problems) - _MAX_LINES} more" if len(problems) > _MAX_LINES else ""
        raise CheckpointError("\n".join(problems[:_MAX_LINES]) + more)
    return manifest


def load(path: str | os.PathLike, model: nn.Module, optimizers: Any = None) -> None:
    """Load the checkpoint in ``path`` into ``model`` (and ``optimizers``); a collective.

    Works at any world size and plan (DCP reshards: every local shard reads its overlap with every
    saved shard). ``optimizers`` must be given as at save time (the same keys). Raises
    ``CheckpointError`` on every rank, with the model and optimizers unchanged, when any file is
    missing, truncated or corrupted (naming it), ``.metadata`` refers to anything but checkpoint
    metadata classes or describes more than a checkpoint holds (``metadata_bounds``), a non-tensor
    record is not a plain value (``safe_records``: no code runs), the checkpoint does not hold what
    the model needs, or an optimizer cannot take its part (param groups, parameters, state shapes):
    every such check runs, agreed by every rank, before the first write. A rank that stalls makes
    the others fail at the process group's timeout with a ``CheckpointError`` naming it. A symbolic
    link ``path`` is followed.
    """
    path = os.path.realpath(os.fspath(path))
    with _naming_silent_ranks("loading checkpoint", path):
        _load(path, model, optimizers)


def _load(path: str, model: nn.Module, optimizers: Any) -> None:
    rank, world = group_rank(None), group_size(None)
    manifest = _agreed(lambda: _verify(path, rank, world), f"verifying checkpoint {path}")

    def _stage():
        metadata = read_metadata_file(os.path.join(path, METADATA_FILE))
        check_storage_files(metadata, manifest["files"], os.path.join(path, METADATA_FILE))
        state, fill = checkpoint_state(model, optimizers)
        staged = staging_copy(state)
        fill_from_metadata(staged, fill, metadata, model)
        return staged, set_aside_absent_records(staged, metadata)

    staged, absent = _agreed(_stage, f"preparing to load {path}")
    try:
        with _quiet_dcp():
            dcp.load(staged, storage_reader=SafeFileSystemReader(path), planner=_ExactLoadPlanner())
    # dcp raises CheckpointException (a BaseException) on every rank when a rank failed
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"reading checkpoint {path} failed: {str(err)[:4000]}") from err
    # every rank checks before any rank writes: a refusal on one rank leaves every rank's model as it was
    # (the model's and every optimizer's checks: apply_state writes nothing that can still be refused)
    _agreed(
        lambda: check_state(model, staged, absent, optimizers),
        f"checking checkpoint {path} against the model",
    )
    _agreed(lambda: apply_state(model, optimizers, staged), f"copying checkpoint {path} into the model")


__all__ = ["load", "save"]
