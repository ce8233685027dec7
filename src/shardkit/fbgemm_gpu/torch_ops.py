"""Importing this module defines fbgemm's jagged ops as ``torch.ops.fbgemm.*``
(:func:`shardkit.fbgemm_gpu.ops.register`): what ``import fbgemm_gpu`` (or ``import torchrec``) does on
fbgemm. The run-as-torchrec mode imports it with ``torchrec`` / ``fbgemm_gpu``; ``shardkit port`` adds
it to a program that calls ``torch.ops.fbgemm``. Nothing else in shardkit imports it."""

from shardkit.fbgemm_gpu.ops import register

register()
