"""torchrec's comm helpers: ``get_qcomm_codecs_registry`` (registry the sharders read, loss scales) and
``JaggedTensorAllToAll`` (rows moved by counts; inconsistent counts fail on every rank)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.codecs import CommType, QCommsConfig, get_qcomm_codecs_registry
from shardkit.sharding.dist_data import JaggedTensorAllToAll
from shardkit.sharding.types import CommOp
from shardkit.sparse import JaggedTensor
from shardkit.testing import run_world


def test_registry_keys_and_loss_scale():
    assert get_qcomm_codecs_registry(QCommsConfig()) is None  # fp32 both ways: nothing to do
    config = QCommsConfig(
        forward_precision=CommType.FP16, backward_precision=CommType.BF16, backward_loss_scale=128.0
    )
    registry = get_qcomm_codecs_registry(config, device=torch.device("cpu"))
    assert sorted(registry) == sorted(op.name for op in CommOp)
    only = get_qcomm_codecs_registry(config, comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL])
    assert list(only) == ["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    codecs = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert codecs.forward.quantized_dtype == torch.float16 and codecs.forward.loss_scale is None
    tiny = torch.tensor([1e-7, 3e-6])
    scaled = codecs.backward.encode(tiny)
    assert torch.equal(scaled, (tiny * 128.0).to(torch.bfloat16))
    torch.testing.assert_close(codecs.backward.decode(scaled), tiny, rtol=1e-2, atol=0)


def _rows(rank: int) -> JaggedTensor:
    # rank 0: [], [0], [1, 2]; rank 1: [10], [11], [12, 13]; weights = values / 10
    lengths = torch.tensor([rank, 1, 2])
    values = torch.arange(int(lengths.sum()), dtype=torch.float32) + 10 * rank
    return JaggedTensor(values, values / 10, lengths=lengths)


def _check_all_to_all() -> None:
    rank = dist.get_rank()  # 2 ranks: rank 0 sends 1 row to 0 and 2 to 1; rank 1 sends 2 to 0, 1 to 1
    send = {0: [1, 2], 1: [2, 1]}[rank]
    receive = {0: [1, 2], 1: [2, 1]}[rank]
    out = JaggedTensorAllToAll(
        _rows(rank), torch.tensor(send), torch.tensor(receive), dist.group.WORLD
    ).wait()
    mine = [row.tolist() for row in out.to_dense()]
    expected = {0: [[], [10.0], [11.0]], 1: [[0.0], [1.0, 2.0], [12.0, 13.0]]}[rank]
    assert mine == expected
    assert torch.allclose(out.weights(), out.values() / 10)
    with pytest.raises(ValueError, match="JaggedTensorAllToAll: (rank 0 expects|1 other rank)"):
        bad_receive = [3, 0] if rank == 0 else receive  # rank 0 expects what rank 1 does not send
        JaggedTensorAllToAll(_rows(rank), send, bad_receive, dist.group.WORLD)


def test_jagged_tensor_all_to_all_moves_rows_and_rejects_mismatched_counts():
    run_world(_check_all_to_all, 2)
