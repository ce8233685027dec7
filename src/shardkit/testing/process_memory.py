"""This process's memory as Linux reports it (``/proc/self/status``), for the tests and benchmarks that
bound an offloaded table's resident set: the peak ``VmHWM`` counts anonymous and mapped file pages
together, and ``reset_peak`` sets it back to the current resident set, so a peak can be taken over one
phase of a run. Off Linux ``memory_mib`` is empty and ``reset_peak`` is False."""

from __future__ import annotations

from typing import Dict

MEMORY_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "VmData")


def memory_mib() -> Dict[str, float]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile`` and ``VmData`` of this process in MiB (float;
    empty where ``/proc/self/status`` cannot be read)."""
    out: Dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key in MEMORY_KEYS:
                    out[key] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def reset_peak() -> bool:
    """``VmHWM`` back to the current resident set (``/proc/self/clear_refs``, Linux >= 4.0); False where
    that is not permitted (then a peak read later covers the whole process)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


__all__ = ["MEMORY_KEYS", "memory_mib", "reset_peak"]
