"""A live engine saved as a ``save_pretrained`` folder, streamed from the shards.

One rank (``writer``) writes every file; every rank takes part in gathering (a collective).
The plan is made from shapes alone (``export.plan``), so every rank knows every file, its
tensors and the order their bytes are written in before anything is gathered: each file's
header first, then its tensors bucket by bucket (``export.bucket_iter`` to the writer), each
bucket written and dropped before the next is gathered. Peak memory, beyond what a rank
holds anyway: the writer one bucket (``bucket_bytes``, or the largest conversion group where
that is larger) plus its conversion's outputs; every other rank its own piece of the tensor
being gathered.

Files go into a temporary directory and are moved into place once every rank agrees that
everything was written (``stream.staged_into``): a failure leaves the folder as it was. A
writer that fails mid-way keeps taking part in the gathers (discarding them), so its peers
never wait for a collective it abandoned; then all of them raise together.
"""

from __future__ import annotations

import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import CheckpointError
from .export import (
    DEFAULT_BUCKET_BYTES,
    Group,
    HubLayout,
    Output,
    Plan,
    bucket_iter,
    buckets,
    check_bucket_bytes,
    check_dtype,
    layout_for,
    plan,
)
from .hf import INDEX, WEIGHTS, _plan_shards, index_json, shard_names
from .stream import StreamedFile, staged_into
from .write import write_atomic

if TYPE_CHECKING:
    from ..engine_view import EngineView

_OLD_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""What an earlier ``save_pretrained`` into the same folder left that this save replaces."""


def save_hub(engine: EngineView, out_dir: str | os.PathLike, *,
             max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, writer: int = 0,
             layout: HubLayout | None = None, weights: str | None = None,
             extra_files: dict[str, bytes] | None = None) -> Path:
    """See ``ZeroEngine.save_pretrained``. ``extra_files`` (name: bytes) are written beside
    the weights by the writer; ``weights`` names the single file (default: the layout's
    ``weights_name``, else ``model.safetensors``; shards and the index take its stem)."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) \
            or max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_size must be a positive number of bytes, got "
                              f"{max_shard_bytes!r}")
    check_bucket_bytes(bucket_bytes)
    check_dtype(dtype)
    if isinstance(writer, bool) or not isinstance(writer, int) \
            or not 0 <= writer < engine.comm.world_size:
        raise CheckpointError(f"writer must be a rank in [0, {engine.comm.world_size}), got "
                              f"{writer!r}")
    chosen = layout if layout is not None else layout_for(engine.module)
    weights = weights or getattr(chosen, "weights_name", WEIGHTS)
    p = plan(engine, chosen, dtype)
    outputs = [Output(o.name, o.shape, p.out_dtype(o.dtype)) for g in p.groups
               for o in g.outputs]
    if not outputs:
        raise CheckpointError(f"{out_dir}: the model holds no tensors to save")
    shards = _plan_shards(outputs, max_shard_bytes)
    names = shard_names(len(shards), weights)
    out = Path(out_dir)
    mine = engine.comm.rank == writer
    error: str | None = None
    agreed = False
    try:
        with ExitStack() as stack:
            tmp = None
            if mine:
                try:
                    tmp = stack.enter_context(staged_into(out, _OLD_WEIGHTS.fullmatch))
                except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
                    error = str(e)
            for name, shard in zip(names, shards):
                path = tmp / name if tmp is not None and error is None else None
                error = _write_file(engine, p, shard, bucket_bytes, writer, path) or error
            if tmp is not None and error is None:
                error = _write_extras(tmp, dict(zip(names, shards)), p,
                                      _extras(chosen, outputs, extra_files), weights)
            failed = engine.comm.failures(error)
            agreed = True
            if failed:  # the writer's temporary files go as this leaves the block
                raise CheckpointError(f"{out}: nothing was saved: " + "; ".join(
                    f"rank {r}: {e}" for r, e in failed))
    finally:
        if agreed:
            # Every rank returns (or raises) once the writer published or cleaned up: a
            # peer may read the folder next.
            engine.comm.failures(None)
    return out


def _extras(layout: HubLayout, outputs: list[Output],
            given: dict[str, bytes] | None) -> dict[str, bytes]:
    """The layout's own files (config.json, recording the dtype written), then ``given``."""
    beside = getattr(layout, "extra_files", None)
    floats = [o.dtype for o in outputs if o.dtype.is_floating_point]
    own = beside(floats[0] if floats else None) if callable(beside) else {}
    return {**own, **(given or {})}


def _write_file(engine: EngineView, p: Plan, shard: list[Output], bucket_bytes: int,
                writer: int, path: Path | None) -> str | None:
    """One file: its tensors gathered to the writer and written by it (into ``path``; None
    where this rank writes nothing or the writer failed already, and the gathers are only
    taken part in). Returns the writer's error, if any."""
    wanted = {o.name for o in shard}
    owner = {o.name: g for g in p.groups for o in g.outputs}
    order: list[tuple[int, list[Group]]] = []
    # Widest dtype first (safetensors' alignment); within one width, group by group.
    for width in sorted({o.dtype.itemsize for o in shard}, reverse=True):
        names = [o.name for o in shard if o.dtype.itemsize == width]
        groups = list({id(owner[n]): owner[n] for n in names}.values())
        order.append((width, groups))
    data_order = [o.name for width, groups in order
                  for bucket in buckets(groups, p.held_bytes, bucket_bytes)
                  for g in bucket for o in g.outputs
                  if o.name in wanted and p.out_dtype(o.dtype).itemsize == width]
    error: str | None = None
    sink: StreamedFile | None = None
    if path is not None:
        try:
            sink = StreamedFile(path, shard, data_order).__enter__()
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            error = f"{path}: {e}"
    for width, groups in order:
        def keep(o: Output, width: int = width) -> bool:
            return o.name in wanted and p.out_dtype(o.dtype).itemsize == width
        for bucket in bucket_iter(engine, p, groups, bucket_bytes, writer, only=keep):
            try:
                for name, value in bucket if sink is not None else ():
                    sink.write(name, value)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - as above
                error, sink = f"{path}: {e}", _abandon(sink, e)
            bucket.clear()  # written: not held while the next bucket is gathered
    if sink is not None:
        try:
            sink.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001 - as above
            error = f"{path}: {e}"
    return error


def _abandon(sink: StreamedFile | None, error: Exception) -> None:
    """Remove the file being written after ``error``."""
    if sink is not None:
        try:
            sink.__exit__(type(error), error, error.__traceback__)
        except Exception:  # noqa: BLE001 - the first error is the one reported
            pass
    return None


def _write_extras(tmp: Path, files: dict[str, list[Output]], p: Plan,
                  extra: dict[str, bytes], weights: str) -> str | None:
    try:
        if len(files) > 1:
            index = INDEX if weights == WEIGHTS else f"{weights}.index.json"
            write_atomic(tmp / index, index_json(files, {"total_parameters": p.num_params}))
        for name, data in extra.items():
            write_atomic(tmp / name, data)
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        return f"{tmp}: {e}"
    return None


__all__ = ["save_hub"]
