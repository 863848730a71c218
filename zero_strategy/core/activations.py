"""Activations, the residual half of ZeRO (ZeRO-R): which modules recompute in backward,
where the inputs they keep rest until then, and how many bytes autograd holds for backward.

A checkpointed module keeps only its inputs from forward (``torch.utils.checkpoint``,
non-reentrant); everything it computes in between is recomputed when backward reaches it.
The inputs are saved through autograd's saved-tensor hooks (the checkpoint saves them with
``save_inputs`` before its own hooks take over the module's inside), so the hooks installed
here around each checkpoint see exactly those inputs and nothing else: they are what
``offload_activations`` moves to the host or to disk, and bring back one module ahead of
backward (recomputation runs modules in reverse order of their forward, so while one module
recomputes, the input of the one before it is on its way).

A framework's layers that carry their own checkpointing switch (a ``LayerKind`` an
integration registered, ``layer_kinds.py``: transformers' ``GradientCheckpointingLayer``) are
checkpointed through it, with this checkpoint function, so the model sees the switch it reads
for its other decisions (transformers turns the KV cache off). Other modules get an
instance ``forward`` that checkpoints the class's. Both stay outside the module's hooks, so
stage 3's gather hooks run once per forward, and the recomputation's gathers are the
runtime's to plan (``runtime.Runtime`` keeps what a recomputation gathered until its backward).

What autograd holds (``measure``) is counted by storage, each once, parameters and buffers
apart: the bytes a forward leaves behind for backward. Counting returns every tensor as it
came (the same object: a copy or ``detach()`` would break backward-of-backward and lose a
parameter's storage that stage 3 swaps), so a measured forward never followed by a backward
is only freed by Python's cycle collector; measuring is therefore opt-in (the first
training forward, and ``measuring()``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import multiprocessing.util
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ZeroConfig
from ..offload.disk import DiskFullError
from ..offload.transfers import Copy, Transfers
from .layer_kinds import LayerKind, kind_of, layer_kinds

PREFETCH_INPUTS = 1
"""Saved inputs brought back beyond the one backward asks for: the next recomputation's,
while this one runs; one is enough to hide a read behind a module's recomputation and keeps
at most two modules' inputs resident during backward."""


def chosen_modules(model: nn.Module, choice: bool | tuple[str, ...]) -> list[nn.Module]:
    """The modules ``activation_checkpointing`` names, outermost only; an error naming the
    field and the model's classes when the choice finds none."""
    if choice is True:
        found = _outermost(model, lambda m: kind_of(m) is not None) or _repeated_blocks(model)
        if not found:
            kinds = "".join(f"{kind.description} and no " for kind in layer_kinds())
            raise ValueError(
                "activation_checkpointing=True found no layers to checkpoint: no "
                f"{kinds}nn.ModuleList/Sequential of "
                "two or more modules of one class. Name the classes instead, e.g. "
                f"activation_checkpointing=[...] from {_class_names(model)}")
        return found
    assert isinstance(choice, tuple)
    found = _outermost(model, lambda m: type(m).__name__ in choice)
    present = {type(m).__name__ for m in found}
    missing = [name for name in choice if name not in present]
    if missing:
        raise ValueError(
            f"activation_checkpointing: no module of class {missing} in the model (or only "
            f"inside another chosen module); its classes: {_class_names(model)}")
    return found


def _class_names(model: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})


def _outermost(model: nn.Module, wanted: Callable[[nn.Module], bool]) -> list[nn.Module]:
    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if wanted(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    def repeated(container: nn.Module) -> bool:
        children = list(container.children())
        return (isinstance(container, (nn.ModuleList, nn.Sequential)) and len(children) >= 2
                and len({type(c) for c in children}) == 1
                and any(True for _ in children[0].parameters()))

    lists = _outermost(model, repeated)
    return [child for container in lists for child in container.children()]


class SavedInputs:
    """Where the checkpointed modules' inputs rest between forward and backward."""

    def __init__(self, tier: str | bool, device: torch.device, transfers: Transfers,
                 directory: str | None, rank: int) -> None:
        self.tier = tier or "device"
        self.device = device
        self.transfers = transfers
        # On a CPU device "cpu" is where the inputs are already: nothing moves.
        self.moves = self.tier == "disk" or (self.tier == "cpu" and device.type != "cpu")
        self._directory = directory
        self._rank = rank
        self._files: tempfile.TemporaryDirectory[str] | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._sequence: list[weakref.ref[_Saved]] = []
        self._by_tensor: dict[int, tuple[weakref.ref[torch.Tensor], _Saved]] = {}
        self._live: weakref.WeakSet[_Saved] = weakref.WeakSet()
        """Every saved input autograd still holds, of any forward: what ``release`` frees."""
        self.label = "activation input"
        """What the checkpoint running now saves (its module's name), for error messages."""
        self.offloaded_bytes = 0
        """Bytes moved off the device by the last forward."""

    def begin_forward(self) -> None:
        self._sequence, self._by_tensor = [], {}
        self.offloaded_bytes = 0

    def end_forward(self) -> None:
        self._by_tensor = {}

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if (not self.moves or isinstance(tensor, nn.Parameter) or tensor.numel() == 0
                or (tensor.device.type != self.device.type)):
            return tensor
        # One copy of a tensor several modules keep (a mask passed to every layer): by
        # object, while it lives (an address alone may be a freed tensor's, reused).
        known = self._by_tensor.get(id(tensor))
        saved = known[1] if known is not None and known[0]() is tensor else None
        if saved is None:
            saved = _Saved(self, tensor, self._sequence)
            self._by_tensor[id(tensor)] = (weakref.ref(tensor), saved)
            self._live.add(saved)
            self.offloaded_bytes += tensor.numel() * tensor.element_size()
        return saved

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        # Its own forward's sequence: a second forward before this backward has its own.
        sequence = packed.sequence
        for earlier in sequence[max(packed.index - PREFETCH_INPUTS, 0) : packed.index]:
            ahead = earlier()
            if ahead is not None:
                ahead.fetch()
        return packed.value()

    # ----------------------------------------------------------- where bytes go
    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Copy | None]:
        """A host copy of a device tensor (pinned, on the side stream), or the tensor itself
        on a CPU device."""
        if tensor.device.type == "cpu":
            return tensor, None
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        return host, self.transfers.copy(host, tensor)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, Copy | None]:
        if self.device.type == "cpu":
            return host, None
        out = torch.empty_like(host, device=self.device)
        return out, self.transfers.copy(out, host)

    def write(self, fn: Callable[[], int | _WriteFailed]) -> Future[int | _WriteFailed]:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="zs-activation-write")
        return self._writer.submit(fn)

    def read(self, fn: Callable[[], torch.Tensor | _WriteFailed]
             ) -> Future[torch.Tensor | _WriteFailed]:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="zs-activation-read")
        return self._reader.submit(fn)

    def new_file(self) -> int:
        """An open file for one saved input, unlinked at once: its blocks return to the
        filesystem when it is closed, or when the process ends however it ends."""
        if self._files is None:
            if self._directory is not None:
                os.makedirs(self._directory, exist_ok=True)
            self._files = tempfile.TemporaryDirectory(
                prefix=f"zs-activations-rank{self._rank}-", dir=self._directory)
            # Removed by close(), when collected, at interpreter exit, and at the exit of a
            # forked worker (multiprocessing skips atexit there), as the disk tier's.
            multiprocessing.util.Finalize(self, self._files.cleanup, exitpriority=10)
        fd, path = tempfile.mkstemp(dir=self._files.name, suffix=".act")
        os.unlink(path)
        return fd

    def release(self) -> int:
        """Close the file (or drop the host copy) of every saved input autograd still holds:
        a pass that failed is abandoned, and whatever still references its graph (an
        exception's traceback, a loss the caller kept) must not keep the disk full. A later
        unpack of one of them raises. Returns how many were released."""
        live = list(self._live)
        for saved in live:
            saved.release()
        self._live = weakref.WeakSet()
        self._sequence, self._by_tensor = [], {}
        return len(live)

    def write_error(self, failure: _WriteFailed, saved: _Saved) -> OSError:
        """The error of a saved input's failed write: the folder, what, the bytes."""
        folder = os.path.dirname(self._files.name) if self._files is not None else (
            self._directory or tempfile.gettempdir())
        try:
            stat = os.statvfs(folder)
            free = f"{stat.f_bavail * stat.f_frsize} bytes free there"
        except OSError:
            free = "its free space unknown"
        full = failure.errno in (errno.ENOSPC, errno.EDQUOT)
        kind = DiskFullError if full else OSError
        return kind(
            failure.errno,
            f"offload_activations='disk': offload_dir={folder!r} has no room for the "
            f"{saved.what} ({saved.nbytes} bytes needed, {failure.done} written; {free}) on "
            f"rank {self._rank}: {failure.strerror}. The step's saved activations are released "
            "and nothing was updated: call engine.zero_grad() and go on (a smaller batch, or "
            "more space in offload_dir)" if full else
            f"offload_activations='disk': writing the {saved.what} ({saved.nbytes} bytes) "
            f"under offload_dir={folder!r} on rank {self._rank} failed after {failure.done} "
            f"bytes: {failure.strerror}. The step's saved activations are released and "
            "nothing was updated: call engine.zero_grad() and go on", folder)

    def close(self) -> None:
        self.release()
        for pool in (self._writer, self._reader):
            if pool is not None:
                pool.shutdown(wait=True)
        self._writer = self._reader = None
        if self._files is not None:
            self._files.cleanup()
            self._files = None


class _Saved:
    """One checkpointed module's input off the device: on the host (a copy from a GPU) or
    in an unlinked file (written on the writer thread). Read back by ``fetch`` (ahead of
    need) or ``value``; kept until autograd drops it, so a second backward
    (``retain_graph``) reads it again."""

    def __init__(self, store: SavedInputs, tensor: torch.Tensor,
                 sequence: list[weakref.ref[_Saved]]) -> None:
        self.store = store
        self.sequence, self.index = sequence, len(sequence)
        sequence.append(weakref.ref(self))
        # An in-place change after this point is what autograd refuses for a saved tensor
        # (its version counter); the copy here cannot see it, so the value is checked
        # against the source's counter when it is read back, if the source still lives.
        self._source, self._version = weakref.ref(tensor), tensor._version
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self.what = store.label
        self._released = False
        self._file: _SavedFile | None = None
        self._host: torch.Tensor | None = None
        self._fetched: (Future[torch.Tensor | _WriteFailed] | tuple[torch.Tensor, Copy | None]
                        | None) = None
        # Given back contiguous: the values are what the recomputation needs (a kernel
        # choice that depends on strides may differ in the last bit from the forward's).
        host, copy = store.to_host(tensor.contiguous())
        if store.tier == "disk":
            fd = store.new_file()
            self._file = _SavedFile(fd, store.write(functools.partial(_write, fd, host, copy)))
            # Through the file object alone: an argument that reached this object (an
            # exception whose traceback holds its frames did) would keep it alive for ever.
            weakref.finalize(self, self._file.close)
        else:
            # the copy up runs on the same side stream after the copy down: no wait here
            self._host = host

    def fetch(self) -> None:
        """Start bringing the input back (a read from disk, a copy to the device)."""
        if self._fetched is not None or self._released:
            return
        if self._file is not None:
            fd, written = self._file.fd, self._file.written
            assert fd is not None
            pinned = self.store.device.type == "cuda"  # so the copy up is asynchronous
            self._fetched = self._file.reading = self.store.read(
                functools.partial(_read, fd, written, self.shape, self.dtype, pinned))
        else:
            assert self._host is not None
            self._fetched = self.store.to_device(self._host)

    def release(self) -> None:
        """Close the file (after the write or read in flight on it) or drop the host copy;
        what needs the value afterwards gets an error."""
        self._released = True
        self._fetched, self._host = None, None
        if self._file is not None:
            self._file.close()

    def value(self) -> torch.Tensor:
        if self._released:
            raise RuntimeError(
                f"offload_activations: the {self.what} was released after an earlier error in "
                "its step (the step was abandoned): call engine.zero_grad() and run a new "
                "forward")
        source = self._source()
        if source is not None and source._version != self._version:
            raise RuntimeError(
                "offload_activations: one of the variables needed for gradient computation "
                "has been modified by an inplace operation: an input a checkpointed module "
                f"kept for its recomputation ({list(source.shape)}) changed after the forward "
                "used it, as autograd refuses for any saved tensor; clone it before changing "
                "it in place")
        self.fetch()
        fetched, self._fetched = self._fetched, None  # a second unpack fetches again
        if isinstance(fetched, Future):
            read = fetched.result()
            if isinstance(read, _WriteFailed):
                # Built here, on this thread: nothing the threads keep points at this step.
                raise self.store.write_error(read, self) from None
            fetched = self.store.to_device(read)
        assert fetched is not None
        tensor, copy = fetched
        if copy is not None:
            copy.wait_device()
        return tensor


class _WriteFailed(NamedTuple):
    """A saved input's write that failed, as a value: an exception kept in a future would
    carry its traceback (and through it the frames of whoever re-raised it, the step's
    graph among them) for as long as the future lives."""

    errno: int
    strerror: str
    done: int


class _SavedFile:
    """One saved input's unlinked file, closed once, after the write and the read on it:
    by autograd dropping the input, or by ``SavedInputs.release`` (a failed pass)."""

    def __init__(self, fd: int, written: Future[int | _WriteFailed]) -> None:
        self.fd: int | None = fd
        self.written = written
        self.reading: Future[Any] | None = None

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        for pending in (self.written, self.reading):  # neither may meet a reused number
            if pending is not None:
                with contextlib.suppress(BaseException):
                    pending.result()
        os.close(fd)


def _write(fd: int, host: torch.Tensor, copy: Copy | None) -> int | _WriteFailed:
    if copy is not None:
        copy.wait_host()
    view = memoryview(host.reshape(-1).view(torch.uint8).numpy())
    written = 0
    try:
        while written < len(view):
            written += os.pwrite(fd, view[written:], written)
    except OSError as e:
        # The blocks written so far go back at once: the file is about to be useless.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        return _WriteFailed(e.errno or errno.EIO, e.strerror or str(e), written)
    return written


def _read(fd: int, written: Future[int | _WriteFailed], shape: tuple[int, ...],
          dtype: torch.dtype, pinned: bool) -> torch.Tensor | _WriteFailed:
    nbytes = written.result()
    if isinstance(nbytes, _WriteFailed):
        return nbytes
    out = torch.empty(shape, dtype=dtype, pin_memory=pinned)
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], done)
        if got <= 0:
            raise OSError(f"offload_activations='disk': short read of a saved input "
                          f"({done} of {nbytes} bytes)")
        done += got
    return out


class SavedBytes:
    """Counts what autograd keeps for backward during a measured forward: each storage
    once, parameters and module buffers apart."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.bytes = 0
        self._seen: set[int] = set()
        self._buffers: set[int] = set()

    def begin(self) -> None:
        self.bytes = 0
        self._seen = set()
        self._buffers = {b.untyped_storage().data_ptr() for b in self.model.buffers()}

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _checked)

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, nn.Parameter):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen and key not in self._buffers:
                self._seen.add(key)
                self.bytes += storage.nbytes()
        # With a hook autograd no longer compares the saved tensor's version at unpack: the
        # hook does, so a measured forward refuses an in-place change as any other does.
        return tensor, tensor._version


def _checked(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {tensor.type()} {list(tensor.shape)} is at version "
            f"{tensor._version}; expected version {version} instead (found while the engine "
            "measured this forward's activations)")
    return tensor


class Activations:
    """The engine's activation policy: checkpointing installed on the chosen modules,
    their saved inputs' tier, and the measurement of what a forward keeps."""

    def __init__(self, model: nn.Module, config: ZeroConfig, device: torch.device,
                 rank: int) -> None:
        choice = config.activation_checkpointing
        self.model = model
        self.modules = chosen_modules(model, choice) if choice else []
        self._names = {id(m): name for name, m in model.named_modules()}
        self._tier, self._device = config.offload_activations, device
        self._directory, self._rank = config.offload_dir, rank
        self.inputs: SavedInputs | None = None
        self.counter = SavedBytes(model)
        self.saved_bytes: int | None = None
        """What the last measured forward left for backward (None: none measured yet)."""
        self._measure_next = True
        self._restore: list[Callable[[], None]] = []

    @property
    def offloaded_bytes(self) -> int:
        return self.inputs.offloaded_bytes if self.inputs is not None else 0

    def install(self, transfers: Transfers) -> None:
        self.inputs = SavedInputs(self._tier, self._device, transfers, self._directory,
                                  self._rank)
        switched: list[LayerKind] = []
        for module in self.modules:
            kind = self._install(module)
            if kind is not None and kind not in switched:
                switched.append(kind)
        # once per kind that switched a layer: the rest of the model reads the same switch
        for kind in switched:
            self._restore.extend(kind.switch_model(self.model))

    def _install(self, module: nn.Module) -> LayerKind | None:
        """Checkpoint ``module``; the kind whose own switch did it, if one did."""
        kind = kind_of(module)
        # Each module's checkpoint carries its name, for the errors of its saved input.
        label = f"activation input of module {self._names.get(id(module), '')!r}"
        if kind is not None:
            self._restore.append(kind.switch_on(module, functools.partial(self._labelled, label)))
            return kind
        original = module.forward  # the class's, bound
        module.forward = functools.partial(self._checkpointed, label, original)
        self._restore.append(functools.partial(_undo_forward, module))
        return None

    def _checkpointed(self, label: str, forward: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # Tensors passed by keyword travel as positional inputs, so the checkpoint saves
        # them (and they can be offloaded) instead of its closure holding them on the device.
        names = list(kwargs)
        count = len(args)

        def run(*inputs: Any) -> Any:
            return forward(*inputs[:count], **dict(zip(names, inputs[count:])))

        return self._labelled(label, run, *args, *kwargs.values())

    def _labelled(self, label: str, function: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> Any:
        if self.inputs is not None:
            self.inputs.label = label
        return self.checkpoint(function, *args, **kwargs)

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``torch.utils.checkpoint`` (non-reentrant), its saved inputs on this tier."""
        inputs = self.inputs
        hooks = inputs.hooks() if inputs is not None and inputs.moves else contextlib.nullcontext()
        with hooks:
            return checkpoint(function, *args, use_reentrant=False, **kwargs)

    @contextlib.contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Around the engine's forward: a fresh sequence of saved inputs, and the count of
        what the forward keeps when this one is measured."""
        training = torch.is_grad_enabled()
        measure = self._measure_next and training
        assert self.inputs is not None, "install() first"
        if training:  # an evaluation saves nothing: the last training forward's figures stay
            self.inputs.begin_forward()
        if measure:
            self._measure_next = False
            self.counter.begin()
        try:
            with self.counter.hooks() if measure else contextlib.nullcontext():
                yield
        finally:
            self.inputs.end_forward()
        if measure:
            self.saved_bytes = self.counter.bytes

    def release_failed(self) -> int:
        """A forward or backward raised: free every saved input still held (files closed,
        host copies dropped), so the next step finds the disk and memory it had."""
        return self.inputs.release() if self.inputs is not None else 0

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Measure the next forward inside this block."""
        self._measure_next = True
        try:
            yield
        finally:
            self._measure_next = False

    def remove(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore = []
        if self.inputs is not None:
            self.inputs.close()


def _undo_forward(module: nn.Module) -> None:
    module.__dict__.pop("forward", None)
