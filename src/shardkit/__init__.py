"""shardkit: model-parallel building blocks for PyTorch."""

__version__ = "0.1.0"
