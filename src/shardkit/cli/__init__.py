"""The ``shardkit`` command."""
