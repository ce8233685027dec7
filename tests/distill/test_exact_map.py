"""build_exact_token_map: strict and relaxed rules, collisions, out-of-vocabulary teacher ids."""

from __future__ import annotations

import pytest
import torch

from shardkit.distill import build_exact_token_map, clear_projection_caches


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_projection_caches()
    yield
    clear_projection_caches()


def _reference(indices, likelihoods, xtoken_loss, v_t):
    """A per-row loop in student order, written from the rules (not vectorized)."""
    v_s, k = indices.shape
    owner = {}  # teacher id -> (student id, top likelihood)
    for s in range(v_s):
        row = likelihoods[s].tolist()
        order = sorted(range(k), key=lambda j: (-row[j], j))
        top, t = row[order[0]], int(indices[s, order[0]])
        if xtoken_loss:
            ok = top >= 0.6
        else:
            ok = top == 1.0 and (k == 1 or int(indices[s, 1]) == -1)
        if not ok or not 0 <= t < v_t:
            continue
        if t not in owner:
            owner[t] = (s, top)
        elif xtoken_loss and top > owner[t][1]:
            owner[t] = (s, top)
    pairs = sorted((s, t) for t, (s, _) in owner.items())
    cs = [s for s, _ in pairs]
    ct = [t for _, t in pairs]
    return cs, ct, [s for s in range(v_s) if s not in cs], [t for t in range(v_t) if t not in ct]


def _save(tmp_path, indices, likelihoods, name="p.pt"):
    path = tmp_path / name
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)
    return path


def test_documented_cases(tmp_path):
    indices = torch.tensor(
        [
            [3, -1],  # 0: strict exact -> 3
            [3, -1],  # 1: strict collision with 0 on 3: lowest student (0) wins
            [5, 1],  # 2: top 1.0 but column 1 is a real id: not strict; relaxed exact -> 5
            [1, 2],  # 3: 0.7 on 1: relaxed only
            [2, 1],  # 4: 0.9 on 1: relaxed collision with 3, higher likelihood wins
            [9, -1],  # 5: teacher id outside the vocabulary: dropped
            [0, 4],  # 6: 0.6 on 4 (second column, after sorting): relaxed exact -> 4
            [4, -1],  # 7: 0.6 on 4 (not 1.0: never strict): tie with 6 -> lowest student id (6) wins
        ]
    )
    likelihoods = torch.tensor(
        [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.7, 0.3], [0.1, 0.9], [1.0, 0.0], [0.4, 0.6], [0.6, 0.0]]
    )
    path = _save(tmp_path, indices, likelihoods)
    strict = build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=6)
    assert strict["common_student"].tolist() == [0]
    assert strict["common_teacher"].tolist() == [3]
    assert strict["uncommon_student"].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert strict["uncommon_teacher"].tolist() == [0, 1, 2, 4, 5]
    relaxed = build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=6)
    assert relaxed["common_student"].tolist() == [0, 2, 4, 6]
    assert relaxed["common_teacher"].tolist() == [3, 5, 1, 4]
    assert relaxed["uncommon_teacher"].tolist() == [0, 2]
    for out in (strict, relaxed):
        assert all(v.dtype == torch.int64 for v in out.values())
    assert build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=6) is relaxed
    small = build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=4)
    assert small["common_student"].tolist() == [0] and small["uncommon_teacher"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("seed", range(6))
def test_random_against_loop(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    v_s, k, v_t = 40, 3, 12
    indices = torch.randint(-1, v_t + 3, (v_s, k), generator=g)  # includes -1 and out-of-vocab ids
    raw = torch.rand(v_s, k, generator=g)
    likelihoods = raw / raw.sum(1, keepdim=True)
    exact = torch.rand(v_s, generator=g) < 0.5
    likelihoods[exact] = torch.tensor([1.0] + [0.0] * (k - 1))
    indices[exact & (torch.rand(v_s, generator=g) < 0.7), 1] = -1
    likelihoods[::7] = torch.tensor([0.6, 0.4, 0.0])  # ties at the relaxed threshold
    path = _save(tmp_path, indices, likelihoods, f"r{seed}.pt")
    for xtoken in (False, True):
        out = build_exact_token_map(path, "cpu", xtoken_loss=xtoken, teacher_vocab_size=v_t)
        cs, ct, us, ut = _reference(indices, likelihoods, xtoken, v_t)
        assert out["common_student"].tolist() == cs
        assert out["common_teacher"].tolist() == ct
        assert out["uncommon_student"].tolist() == us
        assert out["uncommon_teacher"].tolist() == ut


def test_single_column_file_and_sparse_file(tmp_path):
    path = _save(tmp_path, torch.tensor([[1], [0]]), torch.tensor([[1.0], [0.5]]))
    out = build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=2)
    assert out["common_student"].tolist() == [0] and out["common_teacher"].tolist() == [1]
    sparse = tmp_path / "s.pt"
    torch.save({(0, 1): 1.0}, sparse)
    with pytest.raises(ValueError, match="dense top-k"):
        build_exact_token_map(sparse, "cpu", xtoken_loss=False, teacher_vocab_size=2)
