"""The directory ``shardkit run / launch --as-torchrec`` put first on ``PYTHONPATH``: its
``sitecustomize`` switches the run-as-torchrec mode on at interpreter start (shardkit.cli.torchrec_mode)."""
