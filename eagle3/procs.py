"""Child processes that die with the process that started them.

For a parent that is itself SIGKILLed (no finally runs), the kernel's parent-death signal (prctl PR_SET_PDEATHSIG)
kills the child. Note: PDEATHSIG fires when the THREAD that started the child exits, so start children from the
thread that lives for the whole task (Airflow's execute() does).
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; a no-op elsewhere).

    Usable as Popen(preexec_fn=...) (between fork and exec) or as the first call of a spawned child."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux
        return
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent_now(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """die_with_parent for a child already running: if the parent died before the prctl, die now."""
    die_with_parent(sig)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
