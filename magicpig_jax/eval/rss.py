"""Peak resident memory of this process over one measured phase (Linux ``VmHWM``, reset per phase),
and the share of the machine's CPU that other processes used meanwhile.

Writing ``5`` to ``/proc/self/clear_refs`` resets the kernel's peak-RSS mark (Linux >= 4.0), so
one process can report the peak of each benchmark configuration in turn. Where that is not
possible the mark is the process's peak since it started (``resettable`` is False).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

__all__ = ["OtherLoad", "PeakRSS", "cpu_model", "software_versions", "source_revision"]


class PeakRSS:
    """``reset()`` before a phase, ``peak_bytes()`` after it."""

    def __init__(self) -> None:
        self.resettable = sys.platform.startswith("linux") and Path("/proc/self/clear_refs").exists()

    def reset(self) -> None:
        """Start a new phase (a no-op where the mark cannot be reset). The kernel's mark is the
        process's: ``ru_maxrss`` (:func:`magicpig_jax.memory.peak_rss_bytes`) and what
        ``/usr/bin/time -v`` reports restart from here too."""
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


def _cpu_ticks() -> tuple[int, int]:
    """``(busy, total)`` jiffies of the whole machine (``/proc/stat``), (0, 0) where unavailable."""
    try:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


class OtherLoad:
    """The share of the machine's CPU time that other processes used while timing: a run where it is
    not near 0 measured time slices, not the op (the figures of such a run are not comparable)."""

    def __enter__(self):
        self.busy, self.total = _cpu_ticks()
        self.own = time.process_time()
        return self

    def __exit__(self, *exc):
        busy, total = _cpu_ticks()
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        own = (time.process_time() - self.own) * hz
        self.fraction = max(0.0, (busy - self.busy - own) / (total - self.total)) if total > self.total else None
        return False


def software_versions() -> dict[str, str]:
    """The versions a benchmark's figures depend on, for its JSON: jax and jaxlib (XLA's CPU code
    generation changes between releases), and the commit of our own source (:func:`source_revision`)."""
    from importlib.metadata import version

    return {"jax": version("jax"), "jaxlib": version("jaxlib"), "source": source_revision(), "cpu": cpu_model()}


def source_revision() -> str:
    """The commit this package runs from, for a result's provenance: ``git describe --always --dirty``
    of its source checkout (an editable install: ``-dirty`` when tracked files were edited), or
    ``"unknown"`` (an installed wheel, or no git)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]  # <root>/magicpig_jax/eval/rss.py
    if not (root / "pyproject.toml").is_file() or not (root / ".git").exists():
        return "unknown"
    try:
        proc = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``"unknown"``: VMs of one kind differ in it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
