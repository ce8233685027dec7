"""Triton embedding kernels vs the pure-torch reference, on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` has to be set before the kernels are defined, so the cases run in subprocesses
(tests/kernels/_triton_cases.py, two at once) and each test here asserts one case's checks. triton
comes with the ``dev`` extra: when it is missing these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels import _triton_cases as cases

ROOT = Path(__file__).resolve().parents[2]
MARKER = "TRITON_CASES_JSON "


# the cases are shared out over two processes run at once: the interpreter is one core's work, and
# the suite otherwise leaves the second core idle while it waits
PARTS = 2


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.kernels._triton_cases", "cpu", str(part), str(PARTS)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for part in range(PARTS)
    ]
    try:
        outcomes = [_outcome(proc) for proc in procs]
    finally:  # a part failed: the other's process does not outlive the test
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    cases_run = {}
    for outcome in outcomes:
        cases_run.update(outcome["cases"])
    assert sorted(cases_run) == sorted(cases.ALL_CASES)
    return cases_run


def _outcome(proc: subprocess.Popen) -> dict:
    """One part's outcome: its cases' checks, after asserting the kernels were interpreted."""
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = f"{stdout[-3000:]}\n{stderr[-3000:]}"
        pytest.fail(f"the interpreter run failed (exit {proc.returncode}):\n{tail}")
    outcome = json.loads(lines[-1][len(MARKER) :])
    if "error" in outcome:
        pytest.fail(f"{outcome['error']} (triton is in the dev extra: pip install -e '.[dev]')")
    assert outcome["interpreted"], "the kernels were compiled, not interpreted, under TRITON_INTERPRET=1"
    return outcome


def _assert_checks(checks):
    assert checks, "the case made no checks"
    failed = [f"{name}: {detail}" for name, passed, detail in checks if not passed]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("case", cases.FORWARD_CASES)
def test_forward_matches_torch(interpreted, case):
    _assert_checks(interpreted[case])


@pytest.mark.parametrize("case", cases.BACKWARD_CASES)
def test_fused_backward_matches_torch(interpreted, case):
    _assert_checks(interpreted[case])


@pytest.mark.parametrize("case", cases.OTHER_CASES)
def test_edge_cases(interpreted, case):
    _assert_checks(interpreted[case])


@pytest.mark.parametrize("case", cases.CE_CASES)
def test_vocab_parallel_ce_kernels_match_torch(interpreted, case):
    _assert_checks(interpreted[case])


@pytest.mark.parametrize("case", cases.CE_LOSS_CASES)
def test_losses_reach_the_triton_ce_kernels(interpreted, case):
    _assert_checks(interpreted[case])


def test_compiled_kernels_are_not_offered_cpu_tables():
    # this process did not set TRITON_INTERPRET: CPU tables must go to the torch / native backends
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set for the whole test run")
    from shardkit.kernels import select_backend, triton_embedding

    weight = torch.zeros(4, 3)
    assert not triton_embedding.INTERPRETED
    assert not triton_embedding.available(weight)
    assert select_backend(weight, torch.zeros(2, dtype=torch.int64)) in ("torch", "native")


# (kernel, optimizer, flags, D, table dtype): the fused backward's kernels in the specializations that
# matter most; ("segments", 0, {}, 16, ...) is the one Triton 3.6 once failed to compile
COMPILE_CASES = [
    ("segments", 0, {}, 16, "*fp32"),
    ("segments", 1, {"HAS_SCALE": True}, 12, "*fp32"),
    ("segments", 2, {"HAS_PSW": True, "WANT_PSW_GRAD": True}, 128, "*fp32"),
    ("segments", 3, {"POOLED": False}, 64, "*bf16"),
    ("long", 0, {}, 16, "*fp32"),
    ("long", 3, {"HAS_PSW": True, "WANT_PSW_GRAD": True}, 128, "*fp16"),
]


@pytest.mark.parametrize("kernel,opt,flags,dim,weight_type", COMPILE_CASES)
def test_fused_backward_compiles_for_sm90(kernel, opt, flags, dim, weight_type):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set for the whole test run: the kernels are not compiled")
    from shardkit.kernels import triton_embedding as te
    from tests.kernels._triton_compile import compile_for_sm90

    assert te.triton_failure() is None, f"triton is in the dev extra: {te.triton_failure()}"
    constexprs = {"OPT": opt, "POOLED": True, "HAS_PSW": False, "HAS_SCALE": False, "WANT_PSW_GRAD": False}
    constexprs.update(flags)
    if kernel == "segments":
        segs, block_d, _ = te._segment_tile(dim)
        constexprs.update(LONG=te.LONG_SEGMENT, SEGS=segs, BLOCK_D=block_d)
        fn = te._segments_kernel
    else:
        block_n, block_d, _ = te._tile(dim, elements=2048, most_ids=32)
        constexprs.update(BLOCK_N=block_n, BLOCK_D=block_d)
        fn = te._long_segments_kernel
    compiled = compile_for_sm90(fn, constexprs, weight_type, ["D"] if dim % 16 == 0 else [])
    assert compiled.asm.get("ptx"), "no PTX came out"
