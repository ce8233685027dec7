"""Multi-rank test harness, public so that users can test their own sharded code the same way."""

from shardkit.testing.harness import WorldError, run_world, shutdown_workers, worker_pool

__all__ = ["WorldError", "run_world", "shutdown_workers", "worker_pool"]
