"""A clear ImportError for a torchrec name that shardkit does not have (yet).

The modules at torchrec's paths (docs/names.md, "torchrec's module tree") list the names torchrec holds
there that shardkit lacks; ``from shardkit.distributed.embedding import X`` then says which name is missing
and where to look, instead of Python's bare ``cannot import name``.
"""

from __future__ import annotations

from typing import Callable, Iterable, NoReturn

NAMES_DOC = "docs/names.md"


def absent(module: str, names: Iterable[str]) -> Callable[[str], NoReturn]:
    """A module ``__getattr__``: ImportError naming ``module.name`` for the listed names, the usual
    AttributeError for any other (so the import system's probes such as ``__path__`` keep working).

    ``from module import name`` passes an ImportError from ``__getattr__`` through unchanged, where an
    AttributeError would become the bare ``cannot import name``. The cost: ``hasattr(module, name)``
    and ``getattr(module, name, default)`` raise it too, for the listed names only."""
    missing = frozenset(names)
    torchrec_path = "torchrec" + module[len("shardkit") :]

    def __getattr__(name: str) -> NoReturn:  # noqa: N807 - a module's __getattr__
        if name in missing:
            raise ImportError(
                f"{module}.{name}: torchrec's {torchrec_path}.{name} is not in shardkit; "
                f"{NAMES_DOC} lists what shardkit has in its place, docs/spec_names.md every "
                "specification name (and why this one is absent)",
                name=module,
            )
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
