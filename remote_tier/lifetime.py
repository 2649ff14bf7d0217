"""Child processes that die with this one, and the directories they leave behind.

Linux sends a child its parent-death signal when the *thread* that forked it exits, not the
process. So children are forked from one thread that lives as long as the process
(:func:`spawn`), never from a caller's thread that may end first (an executor's worker, a test's
helper thread). Where the signal does not exist (not Linux), a child outlives a SIGKILL of its
parent until the next :func:`sweep`.

A child runs in a directory named after its owner (``<prefix>-<owner pid>-<random>``, made by
:func:`owned_dir`). :func:`sweep` removes the directories whose owner is dead, first killing a
child still running there: one whose PID is recorded in the directory *and* whose current
directory is that directory, so a reused PID is never killed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PID_FILE = "child.pid"


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved before any fork: the child must not load libraries
_launcher: ThreadPoolExecutor | None = None
_launcher_lock = threading.Lock()


def _forget_launcher() -> None:
    global _launcher, _launcher_lock
    _launcher = None  # a forked child inherits no threads,
    _launcher_lock = threading.Lock()  # and maybe a lock another thread held at the fork


os.register_at_fork(after_in_child=_forget_launcher)


def dies_with_parent() -> bool:
    """Whether children of :func:`spawn` get SIGKILL when this process dies (Linux only)."""
    return _PRCTL is not None


def _executor() -> ThreadPoolExecutor:
    global _launcher
    with _launcher_lock:
        if _launcher is None:
            # One worker that idles until the process exits: the forking thread must outlive
            # the children, or they are killed with it.
            _launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-spawn")
        return _launcher


def spawn(args: Sequence[str], *, cwd: str, **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``args`` in ``cwd`` as a child that gets SIGKILL when this process dies,
    SIGKILL included (Linux), and record its PID in ``cwd`` for :func:`sweep`."""
    parent = os.getpid()

    def arm() -> None:  # in the child, between fork and exec
        if _PRCTL is not None:
            _PRCTL(ctypes.c_ulong(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL),
                   ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
            if os.getppid() != parent:  # the parent died before the signal was armed
                os._exit(1)

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(args), cwd=cwd, preexec_fn=arm, **popen)

    proc = _executor().submit(start).result()
    with open(os.path.join(cwd, _PID_FILE), "w") as f:
        f.write(str(proc.pid))
    return proc


def owned_dir(prefix: str) -> str:
    """A new 0700 directory ``<tmp>/<prefix>-<this pid>-<random>``, after sweeping the ones
    whose owner is dead."""
    sweep(prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-")


def sweep(prefix: str, root: str | None = None) -> list[str]:
    """Remove this user's ``<prefix>-<pid>-*`` directories under ``root`` (the temp dir)
    whose owner process is gone, killing a child still running in one; the paths removed."""
    root = root or tempfile.gettempdir()
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-\w+")
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        try:
            if (match is None or not entry.is_dir(follow_symlinks=False)
                    or entry.stat(follow_symlinks=False).st_uid != os.geteuid()
                    or _alive(int(match[1]))):
                continue
        except OSError:
            continue  # removed meanwhile
        _kill_leftover(entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        log.info("swept %d directories of dead owners: %s", len(removed), removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _kill_leftover(path: str) -> None:
    """SIGKILL the child recorded in ``path`` if it still runs there (an owner that died
    where children do not get the parent-death signal)."""
    try:
        with open(os.path.join(path, _PID_FILE)) as f:
            pid = int(f.read().strip())
        if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) != os.path.realpath(path):
            return  # the PID now belongs to another process
        os.kill(pid, signal.SIGKILL)
        log.warning("killed orphan process %d left in %s", pid, path)
    except (OSError, ValueError):
        return
