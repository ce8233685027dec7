"""Teacher logits over shared memory: a second process sees the producer's buffer as a view."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from shardkit.distill import TeacherLogitsBuffer, rebuild_teacher_full_logits_from_ipc


def _consumer(entries, to_producer, from_producer):
    """Runs in a spawned process: open the microbatch view once, then watch it change.

    Values travel back as lists: a tensor put on a queue would itself be shared, and would vanish
    with this process.
    """
    try:
        view = rebuild_teacher_full_logits_from_ipc({"teacher_full_logits_ipc": entries})
        to_producer.put(("first", view.float().tolist(), view.dtype, tuple(view.shape)))
        assert from_producer.get(timeout=60) == "updated"
        # the same view object, not re-opened: it can only see the update if it aliases the buffer
        to_producer.put(("second", view.float().tolist(), None, None))
        view[0, 0, 0] = -123.0  # and writes travel the other way
        if view.is_cuda:
            torch.cuda.synchronize()  # the write must be done before the producer is told
        to_producer.put(("wrote", None, None, None))
    except Exception as err:  # noqa: BLE001 - report any failure to the test process
        to_producer.put(("error", repr(err), None, None))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        # CUDA IPC: a handle must be opened by another process, so this is the only way to test it
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: tools/device_check.sh"),
            ],
        ),
    ],
)
def test_second_process_sees_a_view_and_updates(device):
    buf = TeacherLogitsBuffer((4, 3, 5), dtype=torch.bfloat16, device=device)
    first = torch.randn(4, 3, 5)
    buf.update(first)
    entries = buf.entries()[1:3]  # a microbatch: samples [1, 3)
    ctx = mp.get_context("spawn")
    to_producer, from_producer = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(entries, to_producer, from_producer))
    proc.start()
    try:
        tag, values, dtype, shape = to_producer.get(timeout=120)
        assert tag == "first", values
        assert dtype == torch.bfloat16 and shape == (2, 3, 5)
        assert values == first.to(torch.bfloat16)[1:3].float().tolist()
        second = torch.randn(4, 3, 5)
        buf.update(second)
        from_producer.put("updated")
        tag, values, _, _ = to_producer.get(timeout=60)
        assert tag == "second", values
        assert values == second.to(torch.bfloat16)[1:3].float().tolist()
        tag, err, _, _ = to_producer.get(timeout=60)
        assert tag == "wrote", err
        if device == "cuda":
            torch.cuda.synchronize()  # the consumer's write is on its own stream
        assert buf.tensor[1, 0, 0].item() == -123.0
    finally:
        proc.join(timeout=60)
        buf.close()
    assert proc.exitcode == 0


def test_same_process_view_and_errors():
    buf = TeacherLogitsBuffer((3, 2, 4))
    buf.update(torch.arange(24.0).reshape(3, 2, 4))
    entries = buf.entries()
    assert all(e["rank_logits_ipc"] == entries[0]["rank_logits_ipc"] for e in entries)
    view = rebuild_teacher_full_logits_from_ipc({"teacher_full_logits_ipc": entries[2:]})
    assert view.shape == (1, 2, 4) and torch.equal(view, buf.tensor[2:])
    buf.tensor[2].fill_(7.0)
    assert torch.all(view == 7.0)
    with pytest.raises(KeyError, match="teacher_full_logits_ipc"):
        rebuild_teacher_full_logits_from_ipc({})
    with pytest.raises(ValueError, match="consecutive"):
        rebuild_teacher_full_logits_from_ipc({"teacher_full_logits_ipc": [entries[0], entries[2]]})
    other = TeacherLogitsBuffer((3, 2, 4))
    with pytest.raises(ValueError, match="different handle"):
        rebuild_teacher_full_logits_from_ipc({"teacher_full_logits_ipc": [entries[0], other.entries()[1]]})
    with pytest.raises(ValueError, match="shape"):
        buf.update(torch.zeros(2, 2, 4))
    path = buf.handle()["path"]
    buf.close()
    other.close()
    assert not os.path.exists(path)
    assert torch.all(view == 7.0)  # existing views outlive the name
    with pytest.raises(FileNotFoundError, match="closed"):
        rebuild_teacher_full_logits_from_ipc({"teacher_full_logits_ipc": entries})


def test_handles_open_only_files_shardkit_created(tmp_path):
    """A crafted handle must not resize or write any file: checked before the file is mapped."""
    victim = tmp_path / "important.txt"
    victim.write_bytes(b"keep me")
    buf = TeacherLogitsBuffer((2, 1, 3))
    good = buf.handle()
    shared_dir = os.path.dirname(good["path"])
    link = os.path.join(shared_dir, "shardkit-teacher-logits-link-" + str(os.getpid()))
    os.symlink(victim, link)
    try:
        crafted = {
            "elsewhere": dict(good, path=str(victim)),
            "traversal": dict(good, path=os.path.join(shared_dir, "..", str(victim).lstrip("/"))),
            "other name": dict(good, path=os.path.join(shared_dir, "not-ours")),
            "symlink": dict(good, path=link),
            "too large": dict(good, numel=good["numel"] * 1000),
            "bad shape": dict(good, shape=[2, -1, 3]),
        }
        for handle in crafted.values():
            entries = [{"rank_logits_ipc": handle, "sample_idx_within_rank": 0}]
            with pytest.raises(ValueError, match="refusing|shape must be"):
                rebuild_teacher_full_logits_from_ipc({"teacher_full_logits_ipc": entries})
        assert victim.read_bytes() == b"keep me"  # nothing resized or written
        assert os.path.getsize(good["path"]) == good["numel"] * 4
    finally:
        os.unlink(link)
        buf.close()
