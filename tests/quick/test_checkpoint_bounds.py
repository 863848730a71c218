"""The checks every reader shares (``zero_strategy/checkpoint/bounds.py``): sizes, offsets and
counts from a checkpoint's metadata against what its files store, before anything is
allocated. What they catch in real files: ``test_checkpoint_forgeries.py`` (DCP, quick) and
``tests/integration/test_checkpoint_fuzz.py`` (DeepSpeed and the fuzzer)."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint import bounds
from zero_strategy.checkpoint.pickles import load_torch_file


# ---------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("value, says", [
    ("6", "must be a list"), ([6, 4.0], "must be an int"), ([6, -1], "must be >= 0"),
    ([True], "must be an int"), ([1] * 65, "at most 64"), ([2**30, 2**30], "more than the"),
])
def test_a_shape_is_a_short_list_of_small_counts(value: object, says: str) -> None:
    with pytest.raises(zs.CheckpointError, match=f"^f: 'k': .*{says}"):
        bounds.shape("f", "'k'", value)
    assert bounds.shape("f", "k", torch.Size([6, 4])) == (6, 4)


def test_byte_ranges_stay_inside_and_apart() -> None:
    assert bounds.byte_range("f", "k", 2, 3, 5) == (2, 5)
    with pytest.raises(zs.CheckpointError, match=r"f: k: bytes \[3, 6\) lie outside the file's 5"):
        bounds.byte_range("f", "k", 3, 3, 5)
    bounds.disjoint("f", [(0, 4, "a"), (4, 9, "b"), (9, 9, "empty")])
    with pytest.raises(zs.CheckpointError, match=r"f: b: its bytes \[3, 9\) overlap those of 'a'"):
        bounds.disjoint("f", [(3, 9, "b"), (0, 4, "a")])


def test_chunks_must_cover_the_size_exactly() -> None:
    blocks = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]  # a 2 x 2 tiling of [4, 6]
    bounds.exact_cover("f", "k", (4, 6), blocks)
    bounds.exact_cover("f", "k", (), [((), ())])
    bounds.exact_cover("f", "k", (0, 5), [])
    rows = [((r, 0), (1, 7)) for r in range(20_000)]  # FSDP's row shards: one pass
    bounds.exact_cover("f", "k", (20_000, 7), rows)
    with pytest.raises(zs.CheckpointError, match=r"chunks at \[0, 0\] and \[1, 0\] overlap"):
        bounds.exact_cover("f", "k", (4, 6), [((1, 0), (2, 6)), ((0, 0), (2, 6))])
    with pytest.raises(zs.CheckpointError, match="the chunks hold 12 elements, the size"):
        bounds.exact_cover("f", "k", (4, 6), blocks[:2])
    with pytest.raises(zs.CheckpointError, match=r"chunk at \[3, 0\] of size \[2, 6\] lies "):
        bounds.exact_cover("f", "k", (4, 6), [((0, 0), (2, 6)), ((3, 0), (2, 6))])


def _saved(tmp_path: Path, value: object, name: str = "x.pt") -> Path:
    torch.save(value, tmp_path / name)
    return tmp_path / name


def _record_start(path: Path, suffix: str) -> int:
    """Where the data of the archive's record ending in ``suffix`` begins."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    data = path.read_bytes()
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28],
                                         "little"), int.from_bytes(
        data[info.header_offset + 28 : info.header_offset + 30], "little")
    return info.header_offset + 30 + name_len + extra_len


def test_torch_save_archives_are_checked_record_by_record(tmp_path: Path) -> None:
    """torch.load reads a flipped data byte as a different weight; the CRC-32 that torch.save
    writes (and never checks) catches it."""
    path = _saved(tmp_path, {"w": torch.arange(8.0)})
    bounds.check_archive(path)
    data = bytearray(path.read_bytes())
    data[_record_start(path, "data/0") + 5] ^= 0x10
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(8.0))
    with pytest.raises(zs.CheckpointError, match=r"x\.pt: .*record 'x/data/0' is damaged"):
        bounds.check_archive(path)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(zs.CheckpointError, match="not an intact torch.save archive"):
        bounds.check_archive(path)
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x/data.pkl", pickle.dumps({}))
    with pytest.raises(zs.CheckpointError, match="is compressed"):
        bounds.check_archive(deflated)


def test_an_archive_inside_a_window_of_a_file(tmp_path: Path) -> None:
    blob = io.BytesIO()
    torch.save(torch.ones(3), blob)
    (tmp_path / "two").write_bytes(b"junk" + blob.getvalue() + blob.getvalue())
    bounds.check_archive(tmp_path / "two", "item", 4, len(blob.getvalue()))
    with pytest.raises(zs.CheckpointError, match=r"two: item: .*(damaged|not an intact)"):
        bounds.check_archive(tmp_path / "two", "item", 5, len(blob.getvalue()))


def test_the_old_torch_save_format_is_read_only_when_trusted(tmp_path: Path) -> None:
    """Before torch 1.6 a file allocates the storage sizes it states before they can be
    checked; it is refused unless the user opts in as for any pickle."""
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(zs.CheckpointError, match="not a torch.save zip archive"):
        load_torch_file(path)
    assert torch.equal(load_torch_file(path, trust=True, mmap=False)["w"], torch.ones(2))
