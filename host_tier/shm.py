"""Named shared-memory segments: created 0600 under ``/dev/shm`` with unguessable names.

The creator owns a segment (it unlinks it on :meth:`SharedSegment.close`, when the handle is
garbage-collected, or at interpreter exit); other processes of the same user map it by name with
:meth:`SharedSegment.attach`. Names carry the creator's pid, and creating a segment first
unlinks this user's segments whose creator has died (a SIGKILLed service cannot unlink its own:
without the sweep each crash would leak its whole segment in ``/dev/shm``).
A segment starts with a one-page header holding a magic and a random nonce, so an attacher can
prove it mapped the creator's memory (same host) rather than an unrelated file of that name.
Bytes are exposed as one ``uint8`` tensor; when CUDA exists the creator pins them
(``cudaHostRegister``) so device copies from them are DMA.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import weakref

import torch

from tierstore.errors import UnavailableError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
HEADER_BYTES = 4096
_MAGIC = b"TIERSTORE-SHM-1\0"
_NONCE_BYTES = 32
# {prefix}-{creator pid}-{128 random bits}
_OWNED_NAME = re.compile(r"^tierstore[a-z0-9-]*?-(\d+)-[0-9a-f]{32}$")


class ShmError(UnavailableError, OSError):
    """A segment that cannot be created, found or verified (shared memory unavailable)."""


class SharedSegment:
    """``nbytes`` of shared memory after a header: ``tensor`` is the data, ``name`` the handle.

    Create with :meth:`create` (owner) or :meth:`attach` (another process, by name and nonce).
    """

    def __init__(self, name: str, nonce: bytes, fd: int, total: int, *, owner: bool) -> None:
        self.name = name
        self.nonce = nonce
        self.owner = owner
        self.nbytes = total - HEADER_BYTES
        # MAP_POPULATE maps every page now: first touches of a fresh mapping otherwise cost a
        # fault per 4 KiB inside the copies.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map: mmap.mmap | None = mmap.mmap(fd, total, flags,
                                                mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        full = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensor = full[HEADER_BYTES:]
        self._full: torch.Tensor | None = full
        self.pinned = False
        self._pin()
        # The owner's name goes when the handle does (close, garbage collection or exit).
        self._unlink = weakref.finalize(self, _unlink, name) if owner else None

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, nbytes: int, *, prefix: str = "tierstore") -> SharedSegment:
        """A new zeroed segment of ``nbytes`` (committed up front: running out of ``/dev/shm``
        raises ShmError here, never SIGBUS later), readable and writable only by this user."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        sweep_orphans()
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(16)}"
        nonce = secrets.token_bytes(_NONCE_BYTES)
        total = HEADER_BYTES + nbytes
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ShmError(f"cannot create shared memory in {SHM_DIR}: {exc}") from exc
        try:
            os.fchmod(fd, 0o600)  # whatever the umask did
            os.posix_fallocate(fd, 0, total)
            os.pwrite(fd, _MAGIC + nonce, 0)
        except OSError as exc:
            os.close(fd)
            os.unlink(_path(name))
            raise ShmError(f"cannot allocate {total} B of shared memory in {SHM_DIR}: "
                           f"{exc}") from exc
        log.info("shared segment %s: %.1f MiB", name, nbytes / 2**20)
        return cls(name, nonce, fd, total, owner=True)

    @classmethod
    def attach(cls, name: str, nonce: bytes, nbytes: int) -> SharedSegment:
        """Map the segment ``name`` another process created; ShmError unless it exists here,
        has ``nbytes`` of data and carries ``nonce`` (i.e. it is that process's memory)."""
        if not _valid_name(name):
            raise ShmError(f"not a segment name: {name!r:.80}")
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmError(f"cannot open segment {name}: {exc}") from exc
        try:
            total = os.fstat(fd).st_size
            head = os.pread(fd, len(_MAGIC) + _NONCE_BYTES, 0)
        except OSError as exc:
            os.close(fd)
            raise ShmError(f"cannot read segment {name}: {exc}") from exc
        if total != HEADER_BYTES + nbytes or head != _MAGIC + nonce:
            os.close(fd)
            raise ShmError(f"segment {name} is not the one announced (size {total}, "
                           f"expected {HEADER_BYTES + nbytes}, or another nonce)")
        return cls(name, nonce, fd, total, owner=False)

    def close(self) -> None:
        """Drop this handle's mapping (and, for the owner, unlink the name at once). Views of
        ``tensor`` still alive keep the memory mapped until they go. Idempotent."""
        if self._unlink is not None:
            self._unlink()
        if self._map is None:
            return
        self._unpin()
        # Never mmap.close(): torch tensors over the mapping do not hold a buffer export, so
        # closing would unmap under them. The mapping goes when its last view does.
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._full = None
        self._map = None

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._map is None

    # ------------------------------------------------------------------ pinning
    def _pin(self) -> None:
        if not (self.owner and torch.cuda.is_available()):
            return
        assert self._full is not None
        err = torch.cuda.cudart().cudaHostRegister(self._full.data_ptr(), self._full.numel(), 0)
        self.pinned = int(err) == 0
        if not self.pinned:
            log.warning("cudaHostRegister of segment %s failed (%s): device copies from it "
                        "are staged", self.name, err)

    def _unpin(self) -> None:
        if self.pinned and self._full is not None:
            torch.cuda.cudart().cudaHostUnregister(self._full.data_ptr())
            self.pinned = False


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _valid_name(name: str) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 200 and "/" not in name
            and name not in (".", "..") and name.isprintable())


def available(nbytes: int = 0) -> bool:
    """Whether ``/dev/shm`` exists, is writable and has ``nbytes`` free."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return os.access(SHM_DIR, os.W_OK) and st.f_bavail * st.f_frsize >= nbytes


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))


def sweep_orphans() -> list[str]:
    """Unlink this user's segments whose creating process no longer exists; their names.
    (A pid reused by another process keeps its segment until that process is gone too.)"""
    removed: list[str] = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    me = os.getuid()
    for entry in entries:
        m = _OWNED_NAME.fullmatch(entry.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != me:
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            _unlink(entry.name)
            removed.append(entry.name)
        except OSError:  # alive under another user, or gone meanwhile
            continue
    if removed:
        log.warning("removed %d shared segments left by dead processes: %s", len(removed),
                    ", ".join(removed))
    return removed
