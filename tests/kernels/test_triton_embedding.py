"""Triton embedding kernels vs the pure-torch reference, on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` has to be set before the kernels are defined, so the cases run in one
subprocess (tests/kernels/_triton_cases.py) and each test here asserts one case's checks. triton
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


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels._triton_cases", "cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        pytest.fail(f"the interpreter run failed (exit {proc.returncode}):\n{tail}")
    outcome = json.loads(lines[-1][len(MARKER):])
    if "error" in outcome:
        pytest.fail(f"{outcome['error']} (triton is in the dev extra: pip install -e '.[dev]')")
    assert outcome["interpreted"], "the kernels were compiled, not interpreted, under TRITON_INTERPRET=1"
    return outcome["cases"]


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


def test_compiled_kernels_are_not_offered_cpu_tables():
    # this process did not set TRITON_INTERPRET: CPU tables must go to the torch / native backends
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set for the whole test run")
    from shardkit.kernels import select_backend, triton_embedding

    weight = torch.zeros(4, 3)
    assert not triton_embedding.INTERPRETED
    assert not triton_embedding.available(weight)
    assert select_backend(weight, torch.zeros(2, dtype=torch.int64)) in ("torch", "native")
