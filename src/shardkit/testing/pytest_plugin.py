"""pytest integration: ``--shardkit-timeout``, a ``run_world`` fixture, workers stopped at session end.

Registered through the ``pytest11`` entry point, so it is active wherever shardkit is installed.
"""

from __future__ import annotations

import functools

import pytest

from shardkit.testing import harness


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shardkit-timeout",
        type=float,
        default=harness.DEFAULT_TIMEOUT_S,
        help="seconds a multi-rank task may run before its ranks are killed and the test fails",
    )


@pytest.fixture
def run_world(request: pytest.FixtureRequest):
    """``run_world(fn, world_size, *args, **kwargs)`` with the session's default timeout."""
    timeout = request.config.getoption("--shardkit-timeout")
    return functools.partial(harness.run_world, timeout=timeout)


def pytest_sessionfinish(session: pytest.Session) -> None:
    harness.shutdown_workers()
