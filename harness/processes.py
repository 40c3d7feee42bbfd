"""Child processes that must not outlive moebench."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """In a child (between fork and exec, or first thing in a worker): the kernel sends `sig` when
    `parent` dies, even by kill -9. A parent that died before this took effect ends the child now."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: a killed parent leaves the child to finish alone
        pass
    if os.getppid() != parent:
        sys.exit(1)
