"""The disk tier: offloaded state kept in files, memory-mapped, with the resident part bounded.

Every tensor the tier holds (a unit's master shard, parameter shard, reduced gradient shard,
each optimizer state of each piece) is a ``MAP_SHARED`` mapping of its own file under
``offload_dir``. The engine computes on these tensors exactly as on host memory, so the
arithmetic is the host tier's, bit for bit; only where the bytes rest differs. What keeps the
resident set small is that the engine tells the tier, one unit at a time, what it is about to
use and what it is done with:

- ``prefetch`` asks the kernel to read a unit's files ahead (``MADV_WILLNEED``: readahead
  submitted on a background thread while the current unit computes);
- ``release`` writes a unit's dirty pages back (``msync``), unmaps them (``MADV_DONTNEED``)
  and drops them from the page cache (``POSIX_FADV_DONTNEED``), on a second background
  thread, so write-back overlaps the next unit's compute.

The kernel's page cache is the staging buffer, so there is no pool of bounce buffers to
exhaust, no compiled op and no libaio. Under a memory limit (a cgroup) the kernel also
reclaims clean pages by itself, so a burst beyond what the engine released slows down rather
than fails.

Nothing on disk is ever trusted again, and nothing is left there: each file is unlinked as
soon as it is mapped (its blocks return to the filesystem when the process ends, even by
SIGKILL), inside a ``rank<r>`` directory locked (``flock``) while the engine lives; a
directory whose lock nobody holds was left by a killed process and is emptied before use.
Every file's blocks are reserved when it is created (``posix_fallocate``), optimizer states'
included (the engine creates those files before the first step), so a full disk is an error
when the engine is built, naming the directory and both numbers, never a ``SIGBUS`` on a page
write mid-step.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE")
WRITES_IN_FLIGHT = 3
"""Write-backs (one unit's tensors each) queued before ``release`` waits for the oldest."""
_MS_SYNC = 4
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+: fault the range in now (EINVAL before: skipped)
_MADV_POPULATE_WRITE = 23

_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL around these calls
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_FALLOC_FL_ZERO_RANGE = 0x10


_M_MMAP_THRESHOLD = -3
LARGE_ALLOCATION = 1 << 20


def _large_frees_back_to_kernel() -> None:
    """Serve allocations of 1 MiB and more with their own mappings, returned to the kernel
    when freed. glibc's default raises that threshold to 32 MiB after the first such free,
    after which the unit-sized buffers of building and training (4-64 MiB) come from the heap,
    and the heap keeps freed memory: measured on the 168 M GPT-2, 1.1 GiB held by the heap
    after construction and 1.8 GiB in the second backward, more than the disk tier saves.
    Process-wide, once, only where a disk tier is built (its point is a memory bound)."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION)


class DiskFullError(OSError):
    """The offload directory lacks the space the disk tier needs (names both numbers)."""


@dataclass
class _Mapped:
    path: str
    fd: int
    address: int
    nbytes: int
    tensor: torch.Tensor
    """Held for the engine's life: the mapping (and its address as a key) stays valid."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _call(fn: object, *args: int) -> None:
    if fn(*args) != 0:  # type: ignore[operator]
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class DiskTier:
    """File-backed tensors for one engine rank, and the read-ahead / write-back around them."""

    def __init__(self, directory: str | None, rank: int) -> None:
        _large_frees_back_to_kernel()
        self.owns_root = directory is None
        root = tempfile.mkdtemp(prefix="zero_strategy-offload-") if directory is None else directory
        self.root = os.path.abspath(root)
        self.rank = rank
        self.path = os.path.join(self.root, f"rank{rank}")
        self._lock_fd = self._lock()
        self._files: dict[int, _Mapped] = {}
        self._named: dict[str, torch.Tensor] = {}
        self._count = 0
        self._readers = ThreadPoolExecutor(1, thread_name_prefix="zero-disk-read")
        self._writers = ThreadPoolExecutor(1, thread_name_prefix="zero-disk-write")
        self._pending: list[Future[None]] = []
        self._writes: collections.deque[Future[None]] = collections.deque()
        self._guard = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------------ ownership
    def _lock(self) -> int:
        try:
            os.makedirs(self.root, exist_ok=True)
            lock_path = os.path.join(self.root, f"rank{self.rank}.lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ValueError(f"offload_dir={self.root!r} is not writable: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"offload_dir={self.root!r}: rank {self.rank}'s files are in use by another "
                f"engine (pid {holder}); give each job its own offload_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        # Unlocked leftovers are a killed process's: never trusted, removed.
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        probe = os.path.join(self.path, ".probe")
        try:
            with open(probe, "wb") as f:
                f.write(b"0")
            os.unlink(probe)
        except OSError as e:
            os.close(fd)
            raise ValueError(f"offload_dir={self.root!r} is not writable: {e.strerror}") from e
        return fd

    def check_space(self, needed: int, what: str) -> None:
        """Refuse before writing anything when the directory's filesystem lacks ``needed``."""
        stat = os.statvfs(self.path)
        free = stat.f_bavail * stat.f_frsize
        if free < needed:
            raise DiskFullError(
                errno.ENOSPC,
                f"offload_dir={self.root!r}: the disk tier needs {_gib(needed)} ({needed} "
                f"bytes: {what}) on rank {self.rank}, but its filesystem has {_gib(free)} "
                f"({free} bytes) free")

    # ------------------------------------------------------------------ tensors
    def empty(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        """A tensor of ``numel`` elements in a new file, its blocks reserved; reads as zeros."""
        self._count += 1
        path = os.path.join(self.path, f"{self._count:06d}-{name}.bin")
        nbytes = max(numel * dtype.itemsize, 1)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            stat = os.statvfs(self.path)
            raise DiskFullError(
                e.errno,
                f"offload_dir={self.root!r}: cannot reserve {nbytes} bytes for {name} on rank "
                f"{self.rank} ({e.strerror}; {stat.f_bavail * stat.f_frsize} bytes free); "
                "nothing was changed") from e
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        # Mapped and open, the file needs no name: unlinked now, its blocks go back to the
        # filesystem when the process ends, however it ends (a SIGKILL included).
        os.unlink(path)
        address = tensor.untyped_storage().data_ptr()
        with self._guard:
            self._files[address] = _Mapped(path, fd, address, nbytes, tensor)
        return tensor

    def reserve(self, numel: int, dtype: torch.dtype, name: str) -> None:
        """Create the file ``adopt`` will fill under ``name`` (optimizer state, before the
        first step creates it), so its blocks are reserved when the engine is built."""
        if name not in self._named:
            self._named[name] = self.empty(numel, dtype, name)

    def adopt(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """A file-backed copy of ``tensor`` (optimizer state torch created in host memory),
        in the file last adopted under ``name`` when its size and dtype match (state loaded
        from a checkpoint replaces the values, not the file)."""
        known = self._named.get(name)
        if known is None or known.numel() != tensor.numel() or known.dtype != tensor.dtype:
            known = self.empty(tensor.numel(), tensor.dtype, name)
            self._named[name] = known
        out = known.view(tensor.shape)
        out.copy_(tensor)
        return out

    def zero_range(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` (a whole file of the tier) read as zeros without writing them: its
        pages are dropped and the file's blocks marked unwritten but kept reserved, so the
        next write of a page does not first read the old page from disk. Where the filesystem
        cannot, zeros are written."""
        mapped = self._files.get(tensor.untyped_storage().data_ptr())
        if mapped is None:
            tensor.zero_()
            return
        self.drain_writes()  # a write-back in flight would race the range's new contents
        length = _round_up(mapped.nbytes)
        _call(_libc.madvise, mapped.address, length, _MADV_DONTNEED)
        if _libc.fallocate(mapped.fd, _FALLOC_FL_ZERO_RANGE, 0, mapped.nbytes) != 0:
            tensor.zero_()
            return
        os.posix_fadvise(mapped.fd, 0, mapped.nbytes, os.POSIX_FADV_DONTNEED)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._files

    def disk_bytes(self) -> int:
        return sum(m.nbytes for m in self._files.values())

    def _ranges(self, tensors: list[torch.Tensor]) -> list[_Mapped]:
        out = []
        for t in tensors:
            mapped = self._files.get(t.untyped_storage().data_ptr())
            if mapped is not None and t.numel():
                out.append(mapped)
        return out

    # ------------------------------------------------------------------ streaming
    def prefetch(self, tensors: list[torch.Tensor], write: bool = False) -> None:
        """Start reading ``tensors``' files into memory and mapping their pages (writable
        when ``write``: the caller is about to update them), on the background reader, so
        the compute thread takes no page faults on them; returns at once."""
        ranges = self._ranges(tensors)
        if ranges:
            self._submit(self._readers, _will_need, ranges, write)

    def release(self, tensors: list[torch.Tensor], dirty: bool = True) -> None:
        """Write ``tensors``' pages back (when ``dirty``) and drop them from memory, in the
        background. Their values stay readable: a later read faults them back in."""
        ranges = self._ranges(tensors)
        if ranges and not dirty:  # nothing to write: dropped now, behind no write-back
            _write_back_and_drop(ranges, dirty=False)
            return
        if ranges:
            self._submit(self._writers, _write_back_and_drop, ranges, dirty)
        # Compute may not run further ahead of the disk than a few units: pages waiting for
        # write-back are memory, and under a memory limit the kernel would otherwise stall
        # on them at a moment of its own choosing.
        while len(self._writes) > WRITES_IN_FLIGHT:
            self._writes.popleft().result()

    def _submit(self, pool: ThreadPoolExecutor, fn: object, *args: object) -> None:
        self._pending = [f for f in self._pending if not f.done() or f.exception()]
        future = pool.submit(fn, *args)  # type: ignore[arg-type]
        self._pending.append(future)
        if pool is self._writers:
            self._writes.append(future)

    def drain_writes(self) -> None:
        """Wait for the write-backs submitted so far (they run in order)."""
        while self._writes:
            self._writes.popleft().result()

    def drain(self) -> None:
        """Wait for every background read-ahead and write-back; raise the first I/O error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Wait for the background work, delete the files (a mapping still referenced keeps
        its memory until freed) and the directory; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.drain()
        finally:
            self._readers.shutdown()
            self._writers.shutdown()
            for mapped in self._files.values():
                os.close(mapped.fd)
            self._files.clear()
            self._named.clear()
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            if self.owns_root:
                shutil.rmtree(self.root, ignore_errors=True)
            else:
                try:
                    os.unlink(os.path.join(self.root, f"rank{self.rank}.lock"))
                except FileNotFoundError:
                    pass


def _will_need(ranges: list[_Mapped], write: bool) -> None:
    for m in ranges:  # all reads queued first, so the disk sees them back to back
        _call(_libc.madvise, m.address, _round_up(m.nbytes), _MADV_WILLNEED)
    populate = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    for m in ranges:
        # Where the kernel lacks it (EINVAL), the compute thread takes the faults instead.
        _libc.madvise(m.address, _round_up(m.nbytes), populate)


def _write_back_and_drop(ranges: list[_Mapped], dirty: bool) -> None:
    for m in ranges:
        length = _round_up(m.nbytes)
        if dirty:
            _call(_libc.msync, m.address, length, _MS_SYNC)
        _call(_libc.madvise, m.address, length, _MADV_DONTNEED)
        os.posix_fadvise(m.fd, 0, m.nbytes, os.POSIX_FADV_DONTNEED)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE
