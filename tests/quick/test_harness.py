"""The test harness itself: what a world writes to its temporary directory goes with it."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.harness import check, run_world


def test_a_world_s_temporary_files_are_removed_with_it() -> None:
    # Worlds save models of hundreds of MiB through tempfile; leaked ones once filled the
    # disk under CI. Each world's TMPDIR is a folder of its own, removed when it ends.
    results = check(run_world("tests/worlds/scenarios_scratch.py", 2)["leaves_a_file"])
    tempdirs = {r["tempdir"] for r in results}
    assert len(tempdirs) == 1, tempdirs
    tempdir = Path(tempdirs.pop())
    assert tempdir.name == "tmp" and tempdir.parent.name.startswith("zs-world-"), tempdir
    for r in results:
        assert Path(r["folder"]).parent == tempdir
        assert not os.path.exists(r["folder"]), r["folder"]
    assert not tempdir.parent.exists()
