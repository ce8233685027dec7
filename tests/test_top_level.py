"""The bare package: torchrec's top-level names and subpackages as attributes after ``import shardkit``."""

import subprocess
import sys

import pytest


def test_subpackages_are_attributes_of_the_bare_package():
    # a fresh interpreter: in this one other tests have imported the subpackages already
    code = "import shardkit as s; print(s.optim.RowWiseAdagrad.__name__, s.sparse.KeyedTensor.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["RowWiseAdagrad", "KeyedTensor"]


def test_unknown_attribute_is_an_attribute_error():
    import shardkit

    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = shardkit.nothing_here
