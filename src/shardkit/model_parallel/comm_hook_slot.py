"""DDP's one comm hook slot, shared between shardkit's default hook and the caller's: the caller wins.

DDP's C++ reducer takes one comm hook (``register_comm_hook`` or ``_register_builtin_comm_hook``,
once: "can only be called once" otherwise). ``DefaultDataParallelWrapper`` has a default hook of its
own (the gradient all-reduce through the shared-memory exchange), and a torchrec program may register
its hook on the DDP that ``DistributedModelParallel`` built (``dmp._dmp_wrapped_module.register_comm_hook
(...)``, ``_register_fused_optim``, ...). So that such a program runs unchanged, shardkit's hook yields:

- the wrapper builds :class:`YieldingDistributedDataParallel` (a ``DistributedDataParallel``, nothing
  else changed) and installs its default with its ``install_default_comm_hook``: the reducer gets
  :func:`dispatch_comm_hook`, whose state is a :class:`CommHookSlot` holding the current
  ``(hook, state)``;
- the caller's first ``register_comm_hook(state, hook)`` (DDP's checks of ``hook`` kept) puts its hook
  into the slot: from the next bucket on, the reducer calls it with the caller's state, and
  shardkit's is gone. ``_register_builtin_comm_hook(ALLREDUCE / FP16_COMPRESS)`` puts in the Python
  equivalent of the builtin (``default_hooks.allreduce_hook`` / ``fp16_compress_hook`` over DDP's
  group: the same operations as the C++ hooks, divide then all-reduce);
- any later registration is DDP's own (the reducer raises DDP's error: one hook per DDP).

Where no default was installed (``shm_allreduce=False``, the exchange off or unavailable, a hook
registered while DDP was built, e.g. by torch's ``_apply_optimizer_in_backward``), every method is
DDP's own. A copy of the DDP (``copy.deepcopy``, pickling) gets a new reducer without hooks, as DDP's
copies do: its slot is cleared, so the copy is a plain DDP.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

# builtin hook types and their Python equivalents (the C++ hooks divide by the group size, then sum)
_BUILTIN_EQUIVALENTS = {
    dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
    dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
}


class CommHookSlot:
    """The hook the reducer calls through :func:`dispatch_comm_hook`: ``hook(state, bucket)``.

    ``default`` is True while the hook is shardkit's (the caller's registration replaces it)."""

    def __init__(self, hook: Callable, state: object) -> None:
        self.hook, self.state, self.default = hook, state, True


def dispatch_comm_hook(slot, bucket):  # unannotated: DDP checks real annotations, these are strings
    """The reducer's comm hook: the slot's current hook, with its state."""
    return slot.hook(slot.state, bucket)


class YieldingDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` whose default comm hook (if any) gives way to the caller's first."""

    _default_hook_slot: Optional[CommHookSlot] = None  # set by install_default_comm_hook

    def install_default_comm_hook(self, state: object, hook: Callable) -> bool:
        """Register ``hook`` as the default (a caller's registration replaces it). False, and nothing
        registered, when a hook was registered already (by DDP's constructor)."""
        if self._comm_hooks or self._default_hook_slot is not None:
            return False
        slot = CommHookSlot(hook, state)
        super().register_comm_hook(slot, dispatch_comm_hook)
        self.logger._set_comm_hook_name(hook.__qualname__)
        self._default_hook_slot = slot
        return True

    @property
    def comm_hook(self) -> Optional[tuple]:
        """``(hook, state)`` the reducer calls through the slot; None where no default was installed
        (then the reducer holds DDP's own registration, if any)."""
        slot = self._default_hook_slot
        return None if slot is None else (slot.hook, slot.state)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        slot = self._default_hook_slot
        if slot is None or not slot.default:
            return super().register_comm_hook(state, hook)
        self._check_comm_hook(hook)
        self.logger._set_comm_hook_name(hook.__qualname__)
        slot.hook, slot.state, slot.default = hook, state, False
        self._comm_hooks = [(hook, state)]  # what DDP records (its Python reducer calls these)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        slot = self._default_hook_slot
        if slot is None or not slot.default:
            return super()._register_builtin_comm_hook(comm_hook_type)
        hook = _BUILTIN_EQUIVALENTS.get(comm_hook_type)
        if hook is None:
            raise ValueError(
                f"builtin comm hook {comm_hook_type}: shardkit's DDP replaces its default hook with "
                f"the Python equivalent of one of {sorted(str(t) for t in _BUILTIN_EQUIVALENTS)}"
            )
        self.register_comm_hook(self.process_group, hook)
        self.logger._set_comm_hook_name(str(comm_hook_type))

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._default_hook_slot = None  # the new reducer has no hook: registrations are DDP's own


__all__ = ["CommHookSlot", "YieldingDistributedDataParallel", "dispatch_comm_hook"]
