"""Peak resident memory of this process over one measured phase (Linux ``VmHWM``, reset per phase).

Writing ``5`` to ``/proc/self/clear_refs`` resets the kernel's peak-RSS mark (Linux >= 4.0), so
one process can report the peak of each benchmark configuration in turn. Where that is not
possible the mark is the process's peak since it started (``resettable`` is False).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

__all__ = ["PeakRSS"]


class PeakRSS:
    """``reset()`` before a phase, ``peak_bytes()`` after it."""

    def __init__(self) -> None:
        self.resettable = sys.platform.startswith("linux") and Path("/proc/self/clear_refs").exists()

    def reset(self) -> None:
        """Start a new phase (a no-op where the mark cannot be reset)."""
        if not self.resettable:
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.resettable = False

    def peak_bytes(self) -> int:
        """The peak RSS since the last :meth:`reset` (or since the process started)."""
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) * (1 if sys.platform == "darwin" else 1024)

    def current_bytes(self) -> int:
        """The RSS now (``VmRSS``; 0 where unknown)."""
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0
