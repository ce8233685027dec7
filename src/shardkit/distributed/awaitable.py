"""Awaitables: results of asynchronous work (usually communication) that are waited for when needed.

A sharded module starts its collectives and returns an ``Awaitable`` instead of a tensor, so that the
caller can do other work while the data moves and call ``wait()`` only when it needs the result.

``LazyAwaitable`` goes one step further: it waits by itself the first time its result is *used*, as
an argument of a torch function, by attribute access or by a Python operator. A model can then hand a
``LazyAwaitable`` to code that expects a tensor, and the communication overlaps with whatever runs
before that code touches it, without the model author placing any ``wait()``.

Limits of the lazy mechanism: only torch functions, attribute access and the magic methods generated
below trigger the wait; any other Python function sees the awaitable itself (call ``wait()`` first).
When one torch call takes several lazy arguments they are waited one after the other.

Under ``torch.fx`` symbolic tracing, constructing a ``LazyAwaitable`` from traced values is recorded as
one graph node (torch's ``ProxyableClassMeta``, as torchrec), so a module that returns one traces, and
the traced module builds and waits for it at run time.
"""

from __future__ import annotations

import abc
import enum
import math
import operator
from typing import Any, Callable, Generic, Optional, TypeVar

import torch
from torch.autograd import _profiler_enabled
from torch.fx._symbolic_trace import ProxyableClassMeta

W = TypeVar("W")
K = TypeVar("K")
V = TypeVar("V")


class _Pending(enum.Enum):
    """Marks a LazyAwaitable whose result is not known yet (None is a valid result, so cannot mark it).

    An enum member, unlike ``object()``, stays itself through copy, deepcopy and pickle.
    """

    PENDING = "pending"


_PENDING: Any = _Pending.PENDING


class Awaitable(abc.ABC, Generic[W]):
    """A result of type ``W`` that becomes available after ``wait()``.

    Subclasses implement ``_wait_impl`` (complete the work, return the raw result). ``wait()`` runs it
    and then applies each of ``callbacks`` in order, each taking and returning the result, so that
    post-processing can be attached without waiting (``aw.callbacks.append(fn)``).
    """

    def __init__(self) -> None:
        self._callbacks: list[Callable[[W], W]] = []

    @abc.abstractmethod
    def _wait_impl(self) -> W:
        """Complete the asynchronous work and return its result (before callbacks)."""

    @property
    def callbacks(self) -> list[Callable[[W], W]]:
        """Functions applied to the result, in order, by ``wait()``; append to add one."""
        return self._callbacks

    def wait(self) -> W:
        """Complete the work, apply the callbacks in order and return the result."""
        if _profiler_enabled():
            # named range so that profiler traces show where a step waited on communication; only
            # while a profiler runs: a range costs ~10 us even with no profiler (an op dispatch on
            # entry and exit), and a training step waits ~7 awaitables
            with torch.profiler.record_function(f"## {type(self).__name__} wait() ##"):
                return self._run_callbacks(self._wait_impl())
        return self._run_callbacks(self._wait_impl())

    def _run_callbacks(self, result: W) -> W:
        # the list itself, not the property: a step waits ~7 awaitables, most without callbacks
        for callback in self._callbacks:
            result = callback(result)
        return result


class NoWait(Awaitable[W]):
    """An ``Awaitable`` of an object that is already available (``wait()`` returns it, after callbacks)."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


def _resolve_one(obj: Any) -> Any:
    return obj.wait() if isinstance(obj, LazyAwaitable) else obj


def _resolve(obj: Any) -> Any:
    """``obj`` with every LazyAwaitable in it, also inside lists, tuples and dicts, replaced by its result.

    Containers without awaitables are returned as they are (so a ``torch.Size`` stays one).
    """
    if isinstance(obj, LazyAwaitable):
        return obj.wait()
    if isinstance(obj, (list, tuple)):
        items = [_resolve(item) for item in obj]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        if isinstance(obj, list):
            return items
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return tuple(items)
    if isinstance(obj, dict):
        values = {key: _resolve(value) for key, value in obj.items()}
        if all(values[key] is value for key, value in obj.items()):
            return obj
        return values
    return obj


# Attributes of LazyAwaitable itself, never forwarded to the result.
_OWN_ATTRIBUTES = frozenset({"_lazy_result", "_callbacks", "callbacks", "is_waited", "wait", "_wait_impl"})


class _LazyAwaitableMeta(abc.ABCMeta, ProxyableClassMeta):
    """Abstract methods (``_wait_impl``) plus fx tracing: under ``torch.fx.symbolic_trace`` a
    construction from traced values becomes one graph node instead of running ``__init__``."""


class LazyAwaitable(Awaitable[W], metaclass=_LazyAwaitableMeta):
    """An ``Awaitable`` that waits by itself, once, the first time its result is used.

    Uses that wait: passing it (also nested in lists, tuples, dicts) to a torch function
    (``__torch_function__``), reading an attribute it does not have itself (forwarded to the result),
    and Python operators (arithmetic, reflected arithmetic, comparisons, ``[]``, ``len``, ``iter``,
    ``in``, ``bool``, ``int``, ``float``, ``format``, ...). The result is cached: ``wait()`` and every
    later use return the same object without running ``_wait_impl`` or the callbacks again.

    ``repr()`` and ``hash()`` do not wait (``repr`` says whether it is pending); ``hash`` is by
    identity. Attributes of the awaitable itself (``wait``, ``callbacks``, ``is_waited``) shadow
    those of the result.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lazy_result: Any = _PENDING

    def wait(self) -> W:
        """The result: waited for (with callbacks) on the first call, cached afterwards."""
        # read through __dict__ so that a subclass that skipped __init__ fails in __getattr__ clearly
        result = self.__dict__.get("_lazy_result", _PENDING)
        if result is _PENDING:
            self.__dict__["_lazy_waiting"] = True
            try:
                result = super().wait()
            finally:
                self.__dict__["_lazy_waiting"] = False
            self._lazy_result = result
        return result

    @property
    def is_waited(self) -> bool:
        """Whether the result has been computed (by ``wait()`` or by a use)."""
        return self.__dict__.get("_lazy_result", _PENDING) is not _PENDING

    @property
    def _result(self) -> Optional[W]:
        """torchrec's attribute: the cached result, ``None`` while it is pending (does not wait)."""
        result = self.__dict__.get("_lazy_result", _PENDING)
        return None if result is _PENDING else result

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: tuple,
        args: tuple = (),
        kwargs: Optional[dict] = None,
    ) -> Any:
        # torch found a LazyAwaitable among the arguments: wait for every one, then run func normally
        # (which dispatches again, e.g. to a tensor subclass in the results).
        return func(*_resolve(tuple(args)), **_resolve(dict(kwargs or {})))

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the awaitable does not have. Protocol probes (copy, pickle,
        # numpy) and our own state must not trigger communication.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        # A property of ours that raised AttributeError lands here too (callbacks without _callbacks):
        # forwarding it would wait, which needs the same attribute again, and recurse.
        if name in _OWN_ATTRIBUTES:
            # torchrec's error type for this mistake, so that code catching it keeps working
            raise RuntimeError(
                f"LazyAwaitable type {type(self).__name__} has not been initialized properly (no "
                f"{name!r}): did you forget to call super().__init__()?"
            )
        if self.__dict__.get("_lazy_waiting"):
            # _wait_impl or a callback looked up a missing attribute of the awaitable: forwarding it
            # would wait again, from inside the wait
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r} (looked up while waiting)"
            )
        return getattr(self.wait(), name)

    def __repr__(self) -> str:
        if self.is_waited:
            return f"{type(self).__name__}(waited: {type(self.wait()).__name__})"
        return f"{type(self).__name__}(pending)"

    __hash__ = object.__hash__


class LazyNoWait(LazyAwaitable[W]):
    """A ``LazyAwaitable`` of an object that is already available."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


class LazyGetItemMixin(Generic[K, V]):
    """Mixin for a ``LazyAwaitable`` of a mapping: ``aw[key]`` is itself lazy (a ``GetItemLazyAwaitable``)
    instead of waiting, as torchrec's ``LazyGetItemMixin``. List it before ``LazyAwaitable``:
    ``class A(LazyGetItemMixin[str, Tensor], LazyAwaitable[Dict[str, Tensor]])``.
    """

    def __getitem__(self, key: K) -> GetItemLazyAwaitable[V]:
        return GetItemLazyAwaitable(self, key)


class GetItemLazyAwaitable(LazyAwaitable[W]):
    """``parent[key]``, looked up when first used; waiting for it waits for ``parent`` (once)."""

    def __init__(self, parent: LazyAwaitable[Any], key: Any) -> None:
        super().__init__()
        self._parent = parent
        self._key = key

    def _wait_impl(self) -> W:
        return self._parent.wait()[self._key]


def _forward(op: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: LazyAwaitable, *args: Any) -> Any:
        return op(self.wait(), *[_resolve_one(arg) for arg in args])

    return method


def _forward_reflected(op: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def method(self: LazyAwaitable, other: Any) -> Any:
        return op(_resolve_one(other), self.wait())

    return method


# Binary operators, each also generated as its reflected __r*__ form.
_BINARY_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "matmul": operator.matmul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "divmod": divmod,
    "pow": operator.pow,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
    "and": operator.and_,
    "xor": operator.xor,
    "or": operator.or_,
}

# Everything else forwarded to the result: comparisons, unary operators, conversions, containers.
# No in-place operators: ``x += y`` then falls back to ``x = x + y``, which rebinds x to a result.
_FORWARDED_OPS: dict[str, Callable[..., Any]] = {
    "lt": operator.lt,
    "le": operator.le,
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "ge": operator.ge,
    "neg": operator.neg,
    "pos": operator.pos,
    "abs": abs,
    "invert": operator.invert,
    "bool": bool,
    "int": int,
    "float": float,
    "complex": complex,
    "index": operator.index,
    "round": round,
    "trunc": math.trunc,
    "floor": math.floor,
    "ceil": math.ceil,
    "format": format,
    "str": str,
    "len": len,
    "iter": iter,
    "reversed": reversed,
    "contains": operator.contains,
    "getitem": operator.getitem,
    "setitem": operator.setitem,
    "delitem": operator.delitem,
}


def _install_magic_methods(cls: type) -> None:
    for name, op in _BINARY_OPS.items():
        setattr(cls, f"__{name}__", _forward(op))
        setattr(cls, f"__r{name}__", _forward_reflected(op))
    for name, op in _FORWARDED_OPS.items():
        setattr(cls, f"__{name}__", _forward(op))
    for name in (*_BINARY_OPS, *(f"r{n}" for n in _BINARY_OPS), *_FORWARDED_OPS):
        method = getattr(cls, f"__{name}__")
        method.__name__ = f"__{name}__"
        method.__qualname__ = f"{cls.__name__}.__{name}__"


_install_magic_methods(LazyAwaitable)
