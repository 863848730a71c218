"""Forged and damaged DCP checkpoints the fuzzer (``tests/support/fuzz.py``) found loaders
mishandling, kept as named cases: each on a checkpoint written here by torch's own
``dcp.save`` (its rows re-saved as two chunks, as two ranks' FSDP shards are), each refused
before anything is allocated, naming the file and the key. The DeepSpeed cases need the real
anchor: ``tests/integration/test_checkpoint_fuzz.py``."""

from __future__ import annotations

import contextlib
import io
import pickle
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import zero_strategy as zs

W = "model.w"  # [6, 4]


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    """What ``dcp.save`` writes for a model of one weight, its rows then re-saved as two
    chunks (as two ranks' FSDP shards are), read back equal by torch's own ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    _split_rows(path, W, 3)
    loaded = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}}
    dcp.load(loaded, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    return path


def _edit(path: Path, change: object) -> None:
    meta = pickle.loads((path / ".metadata").read_bytes())  # written by this test
    change(meta)  # type: ignore[operator]
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def _split_rows(path: Path, key: str, rows: int) -> None:
    """Item ``key`` stored as chunks of ``rows`` rows in a data file of their own."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    def change(meta: object) -> None:
        whole = zs.consolidate(path)[key.removeprefix("model.")]
        item, storage = meta.state_dict_metadata[key], meta.storage_data  # type: ignore
        del storage[next(i for i in storage if i.fqn == key)]
        chunks, data = [], io.BytesIO()
        for start in range(0, whole.shape[0], rows):
            offsets, sizes = torch.Size([start, 0]), torch.Size([rows, whole.shape[1]])
            at = data.tell()
            torch.save(whole[start : start + rows].clone(), data)
            storage[MetadataIndex(key, offsets)] = _StorageInfo("__1_0.distcp", at,
                                                                data.tell() - at)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        item.chunks = chunks
        (path / "__1_0.distcp").write_bytes(data.getvalue())

    _edit(path, change)


@contextlib.contextmanager
def address_space(extra: int) -> Iterator[None]:
    """This process may map at most ``extra`` bytes more than it has now (restored after)."""
    vm = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("rows", [6 * 10**11, 6 * 10**7], ids=["terabytes", "gigabytes"])
def test_a_forged_size_is_refused_before_it_is_allocated(dcp_dir: Path, rows: int) -> None:
    """The issue's first finding: ``.metadata`` claiming [rows, 4] for a weight whose chunks
    hold [6, 4]. Terabytes failed to allocate with a bare RuntimeError; gigabytes were
    allocated (as the kernel's overcommit allowed) and only then refused."""
    _edit(dcp_dir, lambda m: setattr(m.state_dict_metadata[W], "size", torch.Size([rows, 4])))
    with address_space(256 << 20), pytest.raises(zs.CheckpointError) as error:
        zs.consolidate(dcp_dir)
    assert str(error.value).startswith(f"{dcp_dir / '.metadata'}: 'model.w': the chunks hold "
                                       f"24 elements, the size [{rows}, 4] has")


def test_overlapping_chunks_never_leave_elements_unread(dcp_dir: Path) -> None:
    """Rows [2, 5) claimed where [3, 6) is stored: the element count still adds up, so the
    old check passed and row 5 came back as whatever the allocator left there."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def overlap(meta: object) -> None:
        chunk = meta.state_dict_metadata[W].chunks[1]  # type: ignore[attr-defined]
        storage = meta.storage_data  # type: ignore[attr-defined]
        storage[MetadataIndex(W, torch.Size([2, 0]))] = storage.pop(
            MetadataIndex(W, torch.Size([3, 0])))
        chunk.offsets = torch.Size([2, 0])

    _edit(dcp_dir, overlap)
    with pytest.raises(zs.CheckpointError, match=r"'model.w': chunks at \[0, 0\] and \[2, 0\] "
                       "overlap"):
        zs.consolidate(dcp_dir)


def test_a_chunk_of_another_dtype_is_refused_not_cast(dcp_dir: Path) -> None:
    _edit(dcp_dir, lambda m: setattr(m.state_dict_metadata[W].properties, "dtype", torch.int8))
    with pytest.raises(zs.CheckpointError, match=r"__1_0\.distcp: item 'model.w' at \[0, 0\] is "
                       r"torch.float32 \[3, 4\], .metadata says torch.int8 \[3, 4\]"):
        zs.consolidate(dcp_dir)


@pytest.mark.parametrize("field, value, says", [
    ("offset", 10**9, r"bytes \[1000000000, .* lie outside the file's"),
    ("length", 40, r"claims 48 bytes, but only 40 are stored"),
    ("relative_path", "../dcp/__1_0.distcp", "is not a plain file or directory name"),
])
def test_a_forged_storage_window_is_refused(dcp_dir: Path, field: str, value: object,
                                            says: str) -> None:
    def forge(meta: object) -> None:
        storage = meta.storage_data  # type: ignore[attr-defined]
        setattr(storage[next(i for i in storage if i.fqn == W)], field, value)

    _edit(dcp_dir, forge)
    with pytest.raises(zs.CheckpointError, match=says):
        zs.consolidate(dcp_dir)


def test_two_items_backed_by_the_same_bytes_are_refused(dcp_dir: Path) -> None:
    """One stored chunk cannot back many claimed ones: the bound on what a checkpoint can
    make a loader allocate is the bytes of its files."""
    def share(meta: object) -> None:
        storage = meta.storage_data  # type: ignore[attr-defined]
        first, second = (storage[i] for i in storage if i.fqn == W)
        second.offset, second.length = first.offset, first.length

    _edit(dcp_dir, share)
    with pytest.raises(zs.CheckpointError, match=r"__1_0\.distcp: model.w at \[3, 0\]: its "
                       r"bytes .* overlap those of 'model.w at \[0, 0\]'"):
        zs.consolidate(dcp_dir)


def test_a_damaged_dcp_item_is_refused(dcp_dir: Path) -> None:
    """A bit of a weight flipped on disk: torch reads it as another weight."""
    data = dcp_dir / "__1_0.distcp"
    blob = bytearray(data.read_bytes())
    first_rows = zs.consolidate(dcp_dir)["w"][:3].numpy().tobytes()
    blob[blob.index(first_rows) + 5] ^= 0x01
    data.write_bytes(bytes(blob))
    with pytest.raises(zs.CheckpointError, match=r"__1_0\.distcp: item 'model.w' at \[0, 0\]"):
        zs.consolidate(dcp_dir)


def test_a_parameter_of_no_elements_converts_and_reads_back(tmp_path: Path) -> None:
    """Found through a forged shape of 0: ``convert --to zero`` wrote a shard of 0 elements,
    which our reader (rightly: every layout holds at least one) refused, and reading a
    parameter of no elements from our format failed in ``torch.cat``."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(6, 4), "empty": torch.zeros(0, 4)},
             "optimizer": {"state": {n: {"exp_avg": torch.ones_like(t), "step": torch.tensor(2.0)}
                                     for n, t in (("w", torch.ones(6, 4)),
                                                  ("empty", torch.zeros(0, 4)))},
                           "param_groups": [{"lr": 0.1, "params": ["w", "empty"]}]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    zs.convert(tmp_path / "dcp", tmp_path / "zero", "zero")
    back = zs.consolidate(tmp_path / "zero")
    assert back["empty"].shape == (0, 4) and torch.equal(back["w"], state["model"]["w"])
    reader = zs.open_reader(tmp_path / "zero")
    assert reader.read_param("empty", "exp_avg").shape == (0, 4)
    assert torch.equal(reader.read_param("w", "exp_avg"), torch.ones(6, 4))
