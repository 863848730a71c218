"""The disk tier: offloaded state kept in files, with the resident part bounded.

Every tensor the tier holds (a unit's master shard, parameter shard, reduced gradient shard,
each optimizer state of each piece) has its own file under ``offload_dir`` and a fixed address
the engine computes on, exactly as on host memory, so the arithmetic is the host tier's, bit
for bit; only where the bytes rest differs. The engine tells the tier, one unit at a time,
what it is about to use and what it is done with, and each tensor's address is backed by one
of three things, changed only here (``_Backing``):

- ``MAPPED``: a ``MAP_SHARED`` mapping of the file. Any read or write is correct (pages fault
  in from the file), so code that touches a tensor nobody read ahead is slow, never wrong.
- ``LOADED``: anonymous memory holding what the file holds. ``prefetch`` reads the file with
  direct I/O (``O_DIRECT``: large sequential reads, no page cache, no page faults on the
  compute thread) into fresh memory on a background thread and moves it onto the tensor's
  address in one ``mremap``: a reader sees the file's values before and after.
- ``ZEROED``: anonymous zeros (a gradient cleared for the next backward: no bytes read).

``release`` writes a resident tensor back with one direct write on a second background
thread and maps the file over it again, freeing the memory; a file mapping is written back
with ``msync`` and dropped. ``release(..., keep=True)`` says the next phase starts with this
tensor (the last units of forward begin backward; the last of backward begin the step): it
stays resident, its write deferred, among the most recent ``keep_bytes`` of such releases;
older ones are written back (when changed) and dropped as newer ones arrive. Whoever uses a
kept tensor again takes it out of that set (``prefetch``, ``ready``, ``zero_range``), so it
is never dropped under a writer; ``drain`` writes every kept tensor back.

Each file's operations run in the order submitted (one waits for the previous), and during
one the address is read-only, so a write the engine makes without waiting first (``ready``)
faults loudly instead of being lost. Where the filesystem refuses ``O_DIRECT`` the tier keeps
every tensor ``MAPPED`` and reads ahead with ``madvise`` (and keeps nothing).

There is no pool of bounce buffers to exhaust, no compiled op and no libaio.

Nothing on disk is ever trusted again, and nothing is left there: each file is unlinked as
soon as it is open and mapped (its blocks return to the filesystem when the process ends, even
by SIGKILL), inside a ``rank<r>`` directory locked (``flock``) while the engine lives; a
directory whose lock nobody holds was left by a killed process and is emptied before use.
Every file's blocks are reserved when it is created (``posix_fallocate``), optimizer states'
included (the engine creates those files before the first step), so a full disk is an error
when the engine is built, naming the directory and both numbers, never a ``SIGBUS`` or
``ENOSPC`` mid-step.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import enum
import errno
import fcntl
import mmap
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE")
WRITES_IN_FLIGHT = 1
"""Write-backs (one unit's tensors each) queued before ``release`` waits for the oldest.
Reads and writes share the disk's throughput (measured: a read and a write at once take as
long as one after the other), so a deeper queue buys no bandwidth, only memory waiting for
the disk; one keeps the writer busy while the reader and the compute thread work (it was 3;
the memory it frees holds the units kept for the next phase)."""
_MS_SYNC = 4
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_POPULATE_READ = 22  # Linux 5.14+: fault the range in now (EINVAL before: skipped)
_MADV_POPULATE_WRITE = 23
_MAP_FIXED = 0x10
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL around these calls
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p]
_libc.mremap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_FALLOC_FL_ZERO_RANGE = 0x10


def keep_budget(unit_numels: list[int], itemsize: int) -> int:
    """Bytes the tier keeps resident for the next phase: one shard or gradient (``itemsize``
    bytes an element, the master's) of each of the two largest units, a constant whatever
    the depth. Backward ends with the first unit forward ran, often the root with the
    embedding, the largest, whose shard the step then begins with. Twice this was measured
    on the 168 M GPT-2 to save a further 0.1 GiB of reads a step, but it raised the peak of
    backward (where it lands) past what a 1 GiB cgroup holds beside the page cache."""
    u1, u2 = [*sorted(unit_numels, reverse=True), 0, 0][:2]
    return (u1 + u2) * itemsize


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


TRIM_EVERY = 4
"""Releases between two returns of the heap's free memory to the kernel (``trim_heap``)."""


def trim_heap() -> None:
    """Give the heap's free pages back to the kernel (``malloc_trim``). The tensors under the
    mapping threshold (a layer's activations and their gradients at short sequences,
    autograd's temporaries) come from the heap, and glibc keeps what they free wherever a
    live allocation sits above it: measured on a 96-layer GPT-2 at 32 tokens, 0.4-0.9 GiB
    of free heap after construction and in backward, growing with depth, which pushed a
    checkpointed model over a 1 GiB cgroup. Returned every few unit releases (about a
    millisecond each), the growth of backward stayed at 0.5 GiB."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


class DiskFullError(OSError):
    """The offload directory lacks the space the disk tier needs (names both numbers)."""


class _Backing(enum.Enum):
    """What a tier tensor's address shows once the operations submitted on it have run."""

    MAPPED = "the file, mapped"
    LOADED = "memory holding the file's values"
    ZEROED = "memory holding zeros (the file is stale)"


@dataclass
class _File:
    path: str
    fd: int
    address: int
    nbytes: int
    tensor: torch.Tensor
    """Held for the engine's life: the address (a key here) stays valid."""
    backing: _Backing = _Backing.MAPPED
    stale: bool = False
    """Resident and changed since its file was last written (kept: the write is deferred)."""
    last: Future[None] | None = field(default=None, repr=False)
    """The latest background operation on this file: the next one waits for it."""
    actual: _Backing = _Backing.MAPPED
    """What the address shows after the last operation that completed (``backing`` is what
    it will show once those submitted have run): what ``recover`` goes back to."""
    unwritten: bool = False
    """A write-back of this resident file failed or never ran (set by the writer): its
    memory holds the values, its file does not."""

    @property
    def length(self) -> int:
        return _round_up(self.nbytes)

    def settle(self) -> None:
        if self.last is not None:
            self.last.result()
            self.last = None

    @property
    def name(self) -> str:
        """The tensor's name in the tier (the file's name without its number)."""
        return os.path.basename(self.path).split("-", 1)[-1].removesuffix(".bin")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _call(fn: object, *args: object) -> None:
    if fn(*args) != 0:  # type: ignore[operator]
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mapped_at(address: int, length: int, prot: int, flags: int, fd: int = -1) -> None:
    """Replace whatever is at ``address`` with a new mapping (``MAP_FIXED``): atomic for
    anyone reading the range."""
    if _libc.mmap(address, length, prot, flags | _MAP_FIXED, fd, 0) != address:
        err = ctypes.get_errno()
        raise OSError(err, f"remapping the disk tier's memory: {os.strerror(err)}")


def _direct_io_works(directory: str) -> bool:
    """Whether files here take ``O_DIRECT`` reads and writes of page-aligned memory."""
    probe = os.path.join(directory, ".direct")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    buffer = mmap.mmap(-1, _PAGE)
    try:
        os.pwrite(fd, buffer, 0)
        return os.preadv(fd, [buffer], 0) == _PAGE
    except OSError:
        return False
    finally:
        buffer.close()
        os.close(fd)
        os.unlink(probe)


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
        self.direct = _direct_io_works(self.path)
        """Reads and writes with ``O_DIRECT`` (else every tensor stays a file mapping)."""
        self._files: dict[int, _File] = {}
        self._named: dict[str, torch.Tensor] = {}
        self._count = 0
        self._readers = ThreadPoolExecutor(1, thread_name_prefix="zero-disk-read")
        self._writers = ThreadPoolExecutor(1, thread_name_prefix="zero-disk-write")
        self._pending: list[Future[None]] = []
        self._writes: collections.deque[Future[None]] = collections.deque()
        self._guard = threading.Lock()
        self._kept: dict[int, _File] = {}
        """Resident files released with ``keep``, oldest first (insertion order)."""
        self.keep_bytes = 0
        """How many bytes of kept files stay resident (0: nothing is kept)."""
        self.read_bytes = 0
        """Bytes read from the files with direct I/O so far (the reader thread's count)."""
        self.written_bytes = 0
        """Bytes written to the files with direct I/O so far (the writer thread's count)."""
        self.reused_bytes = 0
        """Bytes of kept files a read-ahead found in memory: reads the keeping saved."""
        self._releases = 0
        self.closed = False
        self.failed: OSError | None = None
        """The first write-back that failed since the last ``recover`` (set by the writer)."""

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
        direct = os.O_DIRECT if self.direct else 0
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | direct, 0o600)
        try:  # whole pages: direct I/O moves the mapping's last page whole
            os.posix_fallocate(fd, 0, _round_up(nbytes))
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
            self._files[address] = _File(path, fd, address, nbytes, tensor)
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
        self.ready([known])
        out = known.view(tensor.shape)
        out.copy_(tensor)
        return out

    def zero_range(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` (a whole file of the tier) read as zeros without writing them or
        reading the old values: fresh zero memory (written back on release), or, for a file
        mapping, the file's blocks marked unwritten but kept reserved. Where the filesystem
        cannot, zeros are written."""
        f = self._files.get(tensor.untyped_storage().data_ptr())
        if f is None or not tensor.numel():
            tensor.zero_()
            return
        self._claim([f])
        f.settle()
        f.stale = False  # its values are about to be zeros: nothing to write of the old ones
        if self.direct:
            _mapped_at(f.address, f.length, _READ_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            f.backing = f.actual = _Backing.ZEROED
            os.posix_fadvise(f.fd, 0, f.length, os.POSIX_FADV_DONTNEED)
            return
        self.drain_writes()  # a write-back in flight would race the range's new contents
        _call(_libc.madvise, f.address, f.length, _MADV_DONTNEED)
        if _libc.fallocate(f.fd, _FALLOC_FL_ZERO_RANGE, 0, f.nbytes) != 0:
            tensor.zero_()
            return
        os.posix_fadvise(f.fd, 0, f.nbytes, os.POSIX_FADV_DONTNEED)

    def ready(self, tensors: list[torch.Tensor]) -> None:
        """Wait for the reads and write-backs submitted on ``tensors``: needed before writing
        them (a write during either would be lost; the tier makes it fault instead)."""
        files = self._ranges(tensors)
        self._claim(files)  # about to be written: no longer to be dropped behind the writer
        for f in files:
            f.settle()

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Bring ``tensors`` into memory and wait, before reading them whole: a read during
        the transfer would fault every page in from the file through the page cache (the
        bytes read twice), and one of a tensor nobody read ahead would take it a page at a
        time instead of in one direct read."""
        if not self.direct:
            return
        self.prefetch(tensors)
        for f in self._ranges(tensors):
            if f.backing is _Backing.LOADED:  # its latest operation is the read
                f.settle()

    def resident(self, tensors: list[torch.Tensor]) -> bool:
        """Whether every file of ``tensors`` is in memory or on its way (nothing to read)."""
        return all(f.backing is not _Backing.MAPPED for f in self._ranges(tensors))

    @property
    def kept_bytes(self) -> int:
        """Bytes of the files kept resident for the next phase (at most ``keep_bytes``)."""
        return sum(f.length for f in self._kept.values())

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._files

    def file_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes a transfer of ``tensors``' files moves (each file once, in whole pages)."""
        return sum(f.length for f in self._ranges(tensors))

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self._files.values())

    def _ranges(self, tensors: list[torch.Tensor]) -> list[_File]:
        out: dict[int, _File] = {}  # each file once: a transfer must not overlap itself
        for t in tensors:
            f = self._files.get(t.untyped_storage().data_ptr())
            if f is not None and t.numel():
                out[f.address] = f
        return list(out.values())

    # ------------------------------------------------------------------ streaming
    def prefetch(self, tensors: list[torch.Tensor], write: bool = False) -> None:
        """Start reading ``tensors``' files into memory on the background reader, so the
        compute thread neither waits for the disk nor takes page faults on them (``write``:
        the caller is about to update them, which it does after ``ready``); returns at once."""
        files = self._ranges(tensors)
        if not self.direct:
            if files:
                self._submit(self._readers, _will_need, files, write)
            return
        self.reused_bytes += sum(f.length for f in files if f.address in self._kept)
        self._claim(files)  # kept for this use: in memory already
        files = [f for f in files if f.backing is _Backing.MAPPED]
        if files:
            self._chain(self._readers, _load, files, [None] * len(files), _Backing.LOADED)

    def release(self, tensors: list[torch.Tensor], dirty: bool = True,
                keep: bool = False) -> None:
        """Write ``tensors`` back (when ``dirty``) and free their memory, in the background.
        Their values stay readable: the file is mapped where they were. ``keep``: the next
        phase starts with them; resident ones stay so, unwritten, until ``keep_bytes`` of
        later kept releases push them out."""
        files = self._ranges(tensors)
        self._claim(files)  # released again: kept again (if asked) as the newest
        if keep and self.direct and self.keep_bytes:
            for f in files:
                if f.backing is not _Backing.MAPPED:
                    f.stale = f.stale or dirty
                    self._kept[f.address] = f
            files = [f for f in files if f.backing is _Backing.MAPPED]
            self._trim(self.keep_bytes)
            dirty = False  # the kept ones' writes are deferred; a mapping's is msync'd below
        mapped = [f for f in files if f.backing is _Backing.MAPPED]
        resident = [f for f in files if f.backing is not _Backing.MAPPED]
        if mapped and not dirty and all(f.last is None for f in mapped):
            _write_back_and_drop(mapped, dirty=False)  # nothing to write, nothing before it
        elif mapped and not dirty and self.direct:
            pass  # pushed out of memory already: nothing cached to drop, nothing to wait for
        elif mapped:
            self._chain(self._writers, _write_back_and_drop_after, mapped,
                        [dirty] * len(mapped), _Backing.MAPPED)
        if resident:
            self._drop(resident, dirty)
        self._bound_writes()
        self._releases += 1
        if self._releases % TRIM_EVERY == 0:
            trim_heap()

    def _bound_writes(self) -> None:
        """Compute may not run further ahead of the disk than a unit or two: memory waiting
        for write-back is memory, which the bound on the resident set counts."""
        while len(self._writes) > WRITES_IN_FLIGHT:
            self._writes.popleft().result()

    def _drop(self, files: list[_File], dirty: bool) -> None:
        """Write resident ``files`` back where changed (a cleared one: its file marked
        zeros), then map each file over its memory, in the background."""
        actions = [_WRITE if dirty or f.stale else _ZERO if f.backing is _Backing.ZEROED
                   else None for f in files]
        for f in files:
            f.stale = False
        self._chain(self._writers, _store, files, actions, _Backing.MAPPED)

    def _claim(self, files: list[_File]) -> None:
        for f in files:
            self._kept.pop(f.address, None)

    def _trim(self, budget: int) -> None:
        """Drop the oldest kept files until the rest fit in ``budget`` bytes."""
        total, out = self.kept_bytes, []
        while total > budget and self._kept:
            f = self._kept.pop(next(iter(self._kept)))
            total -= f.length
            out.append(f)
        if out:
            self._drop(out, dirty=False)

    def _chain(self, pool: ThreadPoolExecutor, job: object, files: list[_File],
               args: list[object], after: _Backing) -> None:
        """Submit ``job`` on ``files``, each after the file's previous operation."""
        items = [(f, f.last, arg) for f, arg in zip(files, args)]
        future = self._submit(pool, self._counted, job, items)
        for f in files:
            f.last, f.backing = future, after

    def _submit(self, pool: ThreadPoolExecutor, fn: object, *args: object) -> Future[None]:
        self._pending = [f for f in self._pending if not f.done() or f.exception()]
        future = pool.submit(fn, *args)  # type: ignore[arg-type]
        self._pending.append(future)
        if pool is self._writers:
            self._writes.append(future)
        return future

    def _counted(self, job: object, items: _Items) -> None:
        try:
            moved = job(items)  # type: ignore[operator]
        except OSError as cause:
            if job is not _store:
                raise
            error = self._write_error(cause, items)
            if self.failed is None:
                self.failed = error
            raise error from cause
        if job is _load:  # one reader thread, one writer thread: each counter has one adder
            self.read_bytes += moved or 0
        elif job is _store:
            self.written_bytes += moved or 0

    def _write_error(self, cause: OSError, items: _Items) -> OSError:
        """The write-back's error naming the folder, the tensor and the bytes (a full disk:
        ``DiskFullError``, errno 28, as the tier's check at set-up)."""
        failed = [f for f, _, _ in items if f.unwritten]
        what = ", ".join(f"{f.name} ({f.length} bytes)" for f in failed[:3]) or "a tensor"
        if len(failed) > 3:
            what += f" and {len(failed) - 3} more"
        try:
            stat = os.statvfs(self.path)
            free = f"{stat.f_bavail * stat.f_frsize} bytes free"
        except OSError:
            free = "free space unknown"
        code = cause.errno or errno.EIO
        kind = DiskFullError if code in (errno.ENOSPC, errno.EDQUOT) else OSError
        return kind(code, f"offload_dir={self.root!r}: the disk tier could not write back "
                          f"{what} on rank {self.rank} ({cause.strerror or cause}; {free}); "
                          "their values are still in memory: engine.zero_grad() keeps them "
                          "there and writes them again on their next release", self.root)

    def recover(self) -> OSError | None:
        """After a failed write-back: wait for everything submitted (ignoring its errors),
        then make the bookkeeping say what the addresses hold: a file whose write never
        happened stays resident, writable, and is written again on its next release. Returns
        the failure it cleared (None: there was none)."""
        pending, self._pending = self._pending, []
        self._writes.clear()
        for future in pending:
            with contextlib.suppress(BaseException):
                future.result()
        for f in self._files.values():
            f.last = None
            f.backing = f.actual
            if f.unwritten and f.actual is not _Backing.MAPPED:
                _call(_libc.mprotect, f.address, f.length, _READ_WRITE)
                f.stale = True  # the next release writes it
            f.unwritten = False
        failed, self.failed = self.failed, None
        return failed

    def drain_writes(self) -> None:
        """Wait for the write-backs submitted so far (they run in order)."""
        while self._writes:
            self._writes.popleft().result()

    def drain(self, keep_resident: bool = False) -> None:
        """Wait for every background read-ahead and write-back; raise the first I/O error.
        Kept files are written back and dropped first (code that writes the state outside
        the engine's passes, a load, may write them without ``ready``), unless
        ``keep_resident``."""
        if not keep_resident:
            self._trim(0)
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        for f in self._files.values():
            f.last = None

    def close(self) -> None:
        """Wait for the background work, delete the files (a mapping still referenced keeps
        its memory until freed) and the directory; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            # Kept tensors stay in their memory, with their values, for whoever still holds
            # them: the files are about to go (and at interpreter exit no write may start).
            self.drain(keep_resident=True)
            self._kept.clear()
        finally:
            self._readers.shutdown()
            self._writers.shutdown()
            for f in self._files.values():
                os.close(f.fd)
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


_WRITE, _ZERO = "write", "zero"
_Items = list[tuple[_File, "Future[None] | None", object]]


def _transfer(io: object, f: _File, address: int) -> None:
    """All of ``f``'s pages between ``address`` and its file, with direct I/O."""
    done = 0
    while done < f.length:
        view = (ctypes.c_char * (f.length - done)).from_address(address + done)
        moved = io(f.fd, [view], done)  # type: ignore[operator]
        if moved <= 0:
            raise OSError(errno.EIO, f"disk tier: {f.path} moved {done} of {f.length} bytes")
        done += moved


def _load(items: _Items) -> int:
    """Read each file into new memory and move that memory onto the tensor's address; the
    bytes read."""
    total = 0
    for f, previous, _ in items:
        if previous is not None:
            previous.result()
        _call(_libc.mprotect, f.address, f.length, mmap.PROT_READ)  # writers fault, not lost
        staging = _libc.mmap(None, f.length, _READ_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                             -1, 0)
        try:
            if staging in (None, _FAILED):
                raise MemoryError(f"disk tier: no memory to read {f.path} ({f.length} bytes)")
            # Huge pages where the kernel has them: a read fills a few 2 MiB pages instead of
            # thousands of 4 KiB ones (fewer faults to zero, larger requests to the disk),
            # and the tensor's address, 2 MiB aligned for files this size, keeps them when
            # the memory moves there. Measured on the 168 M GPT-2: the step went from 4.0-7.2
            # s to 1.8-2.7 s for the same bytes. Where refused (EINVAL): 4 KiB pages.
            _libc.madvise(staging, f.length, _MADV_HUGEPAGE)
            _transfer(os.preadv, f, staging)
            moved = _libc.mremap(staging, f.length, f.length, _MREMAP_MAYMOVE | _MREMAP_FIXED,
                                 f.address)
            if moved != f.address:
                err = ctypes.get_errno()
                raise OSError(err, f"disk tier: moving {f.path}'s pages: {os.strerror(err)}")
        except BaseException:  # the file mapping stays, writable: slow but correct
            if staging not in (None, _FAILED):
                _libc.munmap(ctypes.c_void_p(staging), f.length)
            _libc.mprotect(f.address, f.length, _READ_WRITE)
            raise
        f.actual = _Backing.LOADED
        total += f.length
    return total


def _store(items: _Items) -> int:
    """Write each resident tensor back (or mark its file zeros) and map the file in its
    place, which frees the memory; the bytes written."""
    moved = 0
    for i, (f, previous, action) in enumerate(items):
        try:
            if previous is not None:
                previous.result()
            _call(_libc.mprotect, f.address, f.length, mmap.PROT_READ)  # writers fault
            if action == _ZERO and _libc.fallocate(f.fd, _FALLOC_FL_ZERO_RANGE, 0,
                                                   f.length) != 0:
                action = _WRITE  # the memory holds the zeros
            if action == _WRITE:
                _transfer(os.pwritev, f, f.address)
                moved += f.length
        except BaseException:
            # Nothing is lost yet: the memory still holds the values of this file and the
            # ones after it (``recover`` makes them writable and writes them again later).
            for g, _, rest in items[i:]:
                g.unwritten = g.unwritten or rest is not None
            f.unwritten = True
            raise
        _mapped_at(f.address, f.length, _READ_WRITE, mmap.MAP_SHARED, f.fd)
        f.actual = _Backing.MAPPED
    return moved


def _will_need(ranges: list[_File], write: bool) -> None:
    for f in ranges:  # all reads queued first, so the disk sees them back to back
        _call(_libc.madvise, f.address, f.length, _MADV_WILLNEED)
    populate = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    for f in ranges:
        # Where the kernel lacks it (EINVAL), the compute thread takes the faults instead.
        _libc.madvise(f.address, f.length, populate)


def _write_back_and_drop(ranges: list[_File], dirty: bool) -> None:
    for f in ranges:
        if dirty:
            _call(_libc.msync, f.address, f.length, _MS_SYNC)
        _call(_libc.madvise, f.address, f.length, _MADV_DONTNEED)
        os.posix_fadvise(f.fd, 0, f.nbytes, os.POSIX_FADV_DONTNEED)


def _write_back_and_drop_after(items: _Items) -> None:
    for f, previous, dirty in items:
        if previous is not None:
            previous.result()
        _write_back_and_drop([f], bool(dirty))


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE
