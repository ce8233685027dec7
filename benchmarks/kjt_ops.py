"""KeyedJaggedTensor / KeyedTensor operations: shardkit vs a naive per-sample Python loop, and a
permute vs a plain memory copy of the same bytes (the physical limit of a data movement).

Run from the repository root: ``python -m benchmarks.kjt_ops [--keys 16 --batch 512 --mean-length 8]``.
Every ratio compares two timings taken in the same run on the same data.
"""

from __future__ import annotations

import argparse
import random
from typing import Dict, List, Optional, Sequence

import torch

from benchmarks.common import median_seconds, write_results
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor

# ---- naive references: one Python step per sample, the way the operation reads on paper ----------


def naive_construct(keys: List[str], values: torch.Tensor, lengths: torch.Tensor, stride: int):
    """Per-key totals and the validation checks, one sample at a time."""
    per_key = [0] * len(keys)
    for row, n in enumerate(lengths.tolist()):
        if n < 0:
            raise ValueError(f"negative length for {keys[row // stride]}")
        per_key[row // stride] += n
    if sum(per_key) != values.numel():
        raise ValueError("lengths do not sum to the number of values")
    return per_key


def _row_offsets(lengths: torch.Tensor) -> List[int]:
    offsets = [0]
    for n in lengths.tolist():
        offsets.append(offsets[-1] + n)
    return offsets


def naive_take_rows(kjt: KeyedJaggedTensor, key_indices: Sequence[int]):
    """Values, weights and lengths of the given keys, gathered one sample (row) at a time."""
    offsets = _row_offsets(kjt.lengths())
    stride, values, weights = kjt.stride(), kjt.values(), kjt.weights_or_none()
    rows = [k * stride + b for k in key_indices for b in range(stride)]
    new_values = torch.cat([values[offsets[r] : offsets[r + 1]] for r in rows])
    new_weights = None if weights is None else torch.cat([weights[offsets[r] : offsets[r + 1]] for r in rows])
    new_lengths = torch.tensor([offsets[r + 1] - offsets[r] for r in rows], dtype=kjt.lengths().dtype)
    return new_values, new_weights, new_lengths


def naive_split(kjt: KeyedJaggedTensor, segments: Sequence[int]):
    out, start = [], 0
    for size in segments:
        out.append(naive_take_rows(kjt, range(start, start + size)))
        start += size
    return out


def naive_to_dict(kjt: KeyedJaggedTensor) -> Dict[str, List[torch.Tensor]]:
    offsets = _row_offsets(kjt.lengths())
    stride, values = kjt.stride(), kjt.values()
    return {
        key: [values[offsets[k * stride + b] : offsets[k * stride + b + 1]] for b in range(stride)]
        for k, key in enumerate(kjt.keys())
    }


def naive_regroup(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """Each output row assembled from per-key slices of the same sample."""
    slices = {key: kt[key] for kt in keyed_tensors for key in kt.keys()}
    batch = keyed_tensors[0].values().size(0)
    return [torch.stack([torch.cat([slices[k][b] for k in group]) for b in range(batch)]) for group in groups]


# ---- data -------------------------------------------------------------------------------------


def make_kjt(num_keys: int, batch: int, mean_length: int, seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * mean_length + 1, (num_keys * batch,), generator=gen, dtype=torch.int32)
    num_values = int(lengths.sum())
    values = torch.randint(0, 10**7, (num_values,), generator=gen, dtype=torch.long)
    weights = torch.rand(num_values, generator=gen)
    keys = [f"f{i}" for i in range(num_keys)]
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)


def make_keyed_tensors(num_tensors: int, keys_each: int, dim: int, batch: int) -> List[KeyedTensor]:
    return [
        KeyedTensor(
            [f"t{t}k{k}" for k in range(keys_each)], [dim] * keys_each, torch.randn(batch, keys_each * dim)
        )
        for t in range(num_tensors)
    ]


# ---- measurement ------------------------------------------------------------------------------


def compare(name: str, fast, naive, repeats: int, naive_repeats: int) -> dict:
    fast_s = median_seconds(fast, repeats=repeats)
    naive_s = median_seconds(naive, repeats=naive_repeats)
    return {"name": name, "shardkit_ms": fast_s * 1e3, "naive_ms": naive_s * 1e3, "speedup": naive_s / fast_s}


def run(num_keys: int, batch: int, mean_length: int, repeats: int, large_batch: int) -> List[dict]:
    kjt = make_kjt(num_keys, batch, mean_length, seed=0)
    keys, values, lengths, weights = kjt.keys(), kjt.values(), kjt.lengths(), kjt.weights()
    per_key = kjt.length_per_key()
    order = list(reversed(range(num_keys)))
    segments = [num_keys // 4] * 3 + [num_keys - 3 * (num_keys // 4)]
    rng = random.Random(0)
    keyed = make_keyed_tensors(4, num_keys // 4 or 1, 64, batch)
    all_keys = [k for kt in keyed for k in kt.keys()]
    groups = [rng.sample(all_keys, len(all_keys) // 3) for _ in range(3)]

    def fresh() -> KeyedJaggedTensor:
        # per-key totals known (as after input_dist), nothing else cached
        return KeyedJaggedTensor(keys, values, weights, lengths, length_per_key=per_key, validate=False)

    # the naive permute's result is the reference for shardkit's
    naive_values, _, naive_lengths = naive_take_rows(kjt, order)
    permuted = kjt.permute(order)
    assert torch.equal(permuted.values(), naive_values) and torch.equal(permuted.lengths(), naive_lengths)

    rows = [
        compare(
            "construct+validate (from_lengths_sync)",
            lambda: KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights),
            lambda: naive_construct(keys, values, lengths, batch),
            repeats,
            3,
        ),
        compare(
            "permute (reverse keys)",
            lambda: fresh().permute(order),
            lambda: naive_take_rows(kjt, order),
            repeats,
            3,
        ),
        compare(
            "split (4 segments)",
            lambda: fresh().split(segments),
            lambda: naive_split(kjt, segments),
            repeats,
            3,
        ),
        compare("to_dict", lambda: fresh().to_dict(), lambda: naive_to_dict(kjt), repeats, 3),
        compare(
            "KeyedTensor.regroup (3 groups)",
            lambda: KeyedTensor.regroup(keyed, groups),
            lambda: naive_regroup(keyed, groups),
            repeats,
            3,
        ),
    ]
    for row in rows[:-1]:
        row["config"] = f"K={num_keys} B={batch} ids={values.numel()}"
    rows[-1]["config"] = f"{len(keyed)} KTs x {len(keyed[0].keys())} keys x dim 64, B={batch}"
    rows += [
        permute_vs_copy(kjt, order, repeats),
        permute_vs_copy(make_kjt(num_keys, large_batch, mean_length, 1), order, repeats),
    ]
    return rows


def permute_vs_copy(kjt: KeyedJaggedTensor, order: List[int], repeats: int) -> dict:
    """A permute reads and writes every value, weight and length once: so does clone() of the three."""
    tensors = (kjt.values(), kjt.weights(), kjt.lengths())
    moved = sum(t.numel() * t.element_size() for t in tensors)
    permute_s = median_seconds(lambda: kjt.permute(order), repeats=repeats)
    copy_s = median_seconds(lambda: [t.clone() for t in tensors], repeats=repeats)
    return {
        "name": "permute vs clone of the same bytes",
        "config": f"K={len(kjt.keys())} B={kjt.stride()} ids={kjt.values().numel()}",
        "shardkit_ms": permute_s * 1e3,
        "clone_ms": copy_s * 1e3,
        "MB_moved": moved / 1e6,
        "permute_GBps": 2 * moved / permute_s / 1e9,
        "clone_GBps": 2 * moved / copy_s / 1e9,
        "clone_over_permute": copy_s / permute_s,
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=16)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--mean-length", type=int, default=8)
    parser.add_argument(
        "--large-batch", type=int, default=16384, help="batch of the second permute-vs-clone row"
    )
    parser.add_argument("--repeats", type=int, default=7)
    # one thread by default: on a shared machine, waking a second intra-op thread for a sub-millisecond
    # copy can cost a scheduler time slice (milliseconds) and swamp what is being measured
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.keys, args.batch, args.mean_length, args.repeats, args.large_batch)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("kjt_ops", config, rows, args.out)


if __name__ == "__main__":
    main()
