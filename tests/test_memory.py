"""magicpig_jax.memory: the peak RSS figure, and freed large buffers going back to the OS."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from magicpig_jax.memory import current_rss_bytes, peak_rss_bytes, release_freed_buffers


def test_peak_is_at_least_the_current_rss():
    now = current_rss_bytes()
    assert now > 0 and peak_rss_bytes() >= now - (4 << 20)  # the kernel syncs per-thread counters lazily


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_large_buffers_leave_the_process():
    assert release_freed_buffers() and release_freed_buffers()  # idempotent
    base = current_rss_bytes()
    bufs = [np.ones(8 << 20, np.uint8) for _ in range(24)]  # 192 MiB in buffers of 8 MiB, touched
    assert current_rss_bytes() - base > 150 << 20
    del bufs
    assert current_rss_bytes() - base < 24 << 20
