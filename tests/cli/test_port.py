"""``shardkit port``: a program's torchrec / fbgemm_gpu imports become shardkit's, every other
character stays, and the ported imports bind the names the program uses."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shardkit.cli.main import main
from shardkit.cli.port import OPS_IMPORT, port_source

SAMPLE = textwrap.dedent(
    """\
    import os, torchrec  # torchrec stays in comments
    import torchrec.distributed as trec_dist
    import torchrec.distributed.planner
    from torchrec.distributed.embeddingbag import (
        EmbeddingBagCollectionSharder,  # torchrec.distributed
    )
    from torchrec import KeyedJaggedTensor as KJT
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    import fbgemm_gpu
    import fbgemm_gpu.split_table_batched_embeddings_ops_common as tbe
    import torchrec_contrib_not_ours
    text = "import torchrec"
    if True:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    import torch
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor([1, 2]))
    """
)

PORTED = textwrap.dedent(
    """\
    import os, shardkit as torchrec; import shardkit.fbgemm_gpu.torch_ops  # torchrec stays in comments
    import shardkit.distributed as trec_dist
    import shardkit.distributed.planner, shardkit as torchrec
    from shardkit.distributed.embeddingbag import (
        EmbeddingBagCollectionSharder,  # torchrec.distributed
    )
    from shardkit import KeyedJaggedTensor as KJT
    from shardkit.fbgemm_gpu.split_embedding_configs import EmbOptimType
    import shardkit.fbgemm_gpu as fbgemm_gpu
    import shardkit.fbgemm_gpu.split_table_batched_embeddings_ops_common as tbe
    import torchrec_contrib_not_ours
    text = "import torchrec"
    if True:
        from shardkit.sparse.jagged_tensor import KeyedJaggedTensor
    import torch
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor([1, 2]))
    """
)


def test_port_rewrites_only_the_imports():
    new, notes = port_source(SAMPLE)
    assert new == PORTED
    assert notes == []


def test_a_program_without_torchrec_imports_is_unchanged():
    source = "from . import torchrec\nimport torchrecx\nx = 'torchrec.distributed'  # torchrec\n"
    assert port_source(source) == (source, [])


def test_torch_ops_fbgemm_without_torchrec_imports_is_a_note():
    source = "import torch\ny = torch.ops.fbgemm.jagged_2d_to_dense\n"
    new, notes = port_source(source, "prog.py")
    assert new == source
    assert notes == [f"prog.py: calls torch.ops.fbgemm but imports no torchrec: add `{OPS_IMPORT}`"]


def test_the_ported_imports_bind_what_the_program_uses(tmp_path):
    program = PORTED.replace("import torchrec_contrib_not_ours\n", "") + textwrap.dedent(
        """\
        import shardkit.distributed.planner as planner
        import shardkit.modules
        assert torchrec.__name__ == "shardkit" and trec_dist.__name__ == "shardkit.distributed"
        assert torchrec.distributed.planner is planner
        assert KJT is KeyedJaggedTensor and EmbOptimType is shardkit.modules.OptimType
        assert fbgemm_gpu.__name__ == "shardkit.fbgemm_gpu" and tbe.PoolingMode.SUM == 0
        assert offsets.tolist() == [0, 1, 3]
        print("ok")
        """
    )
    path = tmp_path / "ported.py"
    path.write_text(program)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n"


def test_port_command_prints_the_diff_and_writes_only_when_asked(tmp_path, capsys):
    path = tmp_path / "prog.py"
    path.write_text(SAMPLE)
    assert main(["port", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"--- {path}\n+++ {path}\n@@ ")
    assert "\n-from torchrec import KeyedJaggedTensor as KJT\n" in out
    assert "\n+from shardkit import KeyedJaggedTensor as KJT\n" in out
    assert '\n text = "import torchrec"\n' in out  # context lines, unchanged
    assert path.read_text() == SAMPLE
    assert main(["port", "--write", str(path)]) == 0
    assert path.read_text() == PORTED
    capsys.readouterr()
    assert main(["port", str(path)]) == 0  # nothing left to port
    assert capsys.readouterr().out == ""


def test_port_names_a_file_it_cannot_read_or_parse(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import torchrec\ndef broken(:\n")
    good = tmp_path / "good.py"
    good.write_text("import torchrec\n")
    assert main(["port", str(bad), str(tmp_path / "missing.py"), str(good)]) == 1
    captured = capsys.readouterr()
    errors = captured.err.splitlines()
    assert len(errors) == 2
    assert errors[0].startswith(f"shardkit port: error: {bad}: ") and "invalid syntax" in errors[0]
    assert errors[1].startswith(f"shardkit port: error: {tmp_path / 'missing.py'}: ")
    assert "+import shardkit as torchrec\n" in captured.out  # the good file is still ported


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "import torchrec.distributed as d, torchrec\n",
            "import shardkit.distributed as d, shardkit as torchrec\n",
        ),
        ("import  torchrec   as   t\n", "import  shardkit as t\n"),
        (
            "from torchrec.distributed.types import (ShardingType)\n",
            "from shardkit.distributed.types import (ShardingType)\n",
        ),
        (
            "try:\n    import torchrec\nexcept ImportError:\n    pass\n",
            "try:\n    import shardkit as torchrec\nexcept ImportError:\n    pass\n",
        ),
        ("x = 'é'; import torchrec\n", "x = 'é'; import shardkit as torchrec\n"),
    ],
)
def test_port_spellings(source, expected):
    assert port_source(source) == (expected, [])
