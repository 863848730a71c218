"""Checkpoints a stranger could hand us, made from real ones: DeepSpeed 0.19 ZeRO-3 and FSDP2's
DCP (written by the anchors, ``tests/worlds/fuzz_sources.py``) and ours.

``test_the_fuzzer_finds_nothing`` runs ``tests/support/fuzz.py`` on every named mutation and
20 random ones through every loader (each case meets the engine and ``zero-strategy
consolidate``, and one of the other four in turn); the long mode (``python -m
tests.support.fuzz --cases N``, docs/testing.md) runs every loader on every case. Each thing
the fuzzer found is kept below as a named case on the real files, refused through the three
file loaders in this process; the cheap DCP ones are in the quick tier too
(``tests/quick/test_checkpoint_forgeries.py``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fuzz import make_sources
from tests.support.harness import ROOT
from tests.support.mutations import SOURCES, Context, catalogue

pytest.importorskip("deepspeed", reason="deepspeed not installed (the anchors extra)")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sources(tmp_path_factory.mktemp("fuzz-sources"))


def test_the_fuzzer_finds_nothing(sources: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.support.fuzz",
                          "--sources", str(sources), "--cases", "20", "--seed", "0",
                          "--rotate", "--report", str(report)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert report.exists(), run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(report.read_text())
    assert result["findings"] == [], run.stdout[-6000:]
    named = sum(len(catalogue(s)) for s in SOURCES)
    assert result["cases"] == len(SOURCES) + named + 20  # the originals, named, random
    assert result["refused"] > 2 * named and result["loaded"] > 20
    assert run.returncode == 0


# What the fuzzer found (on the code before it), each refused now: (source/mutation, what
# the loaders did).
FOUND = {
    "dcp/size_huge": "the issue's finding 1: allocated 4.4 TB from .metadata, a bare "
                     "RuntimeError (smaller forgeries were allocated, then refused)",
    "ds3/model_rank1_missing": "the issue's finding 2: loaded without a rank's model states",
    "dcp/chunk_overlaps": "loaded, with a row never read (whatever torch.empty held)",
    "dcp/dtype_narrower": "loaded, each float chunk cast into an int8 tensor",
    "dcp/data_flipped": "loaded a weight damaged on disk (torch ignores the zip CRC)",
    "ds3/optim_flipped": "loaded a master weight damaged on disk",
    "ds3/master_int": "loaded an int64 'master'",
    "ds3/exp_avg_short": "IndexError reading a rank whose moments are shorter",
    "dcp/size_smaller": "RuntimeError copying a chunk past the size",
    "dcp/size_extra_dim": "RuntimeError copying a chunk",
    "dcp/size_negative": "RuntimeError: negative dimension",
    "dcp/size_not_ints": "TypeError from torch.Size",
    "dcp/dtype_not_dtype": "TypeError from torch.empty",
    "dcp/chunks_not_list": "AttributeError",
    "ds3/master_not_tensor": "AttributeError",
    "ds3/shapes_not_dict": "AttributeError",
    "ds3/shared_not_dict": "AttributeError",
    "ds3/steps_not_int": "ValueError from int()",
    "dcp/metadata_fifo": "refused as 'no manifest.json', not naming the FIFO",
    "dcp/path_traversal": "read a data file through '..' (inside the directory, but not a "
                          "name DCP writes)",
    "ds2/model_states_symlink_out": "read the model states through a link out of the "
                                    "directory (stages 1-2 only)",
    "ds2/padding_negative": "loaded every later weight of the group shifted",
    "ds2/paddings_short": "IndexError",
    "ds2/master_last_short": "IndexError reading the last rank's partition",
    "ds2/exp_avg_rank0_short": "IndexError (or loaded, when reading weights only)",
    "ds2/model_states_missing": "refused as 'manifest.json is missing'",
    "ds2/shape_smaller": "loaded every later weight of the group shifted (found at random: "
                         "seed 1, case 19)",
    "dcp/params_not_list": "TypeError (a param group's 'params' item re-saved as an int)",
    "dcp/step_nan": "loaded Adam's step as NaN into the engine; `convert --to zero` wrote a "
                    "manifest our reader refuses",
    "ours/slot_in_padding": "loaded a weight one element off (a slot moved within the "
                            "padding of our manifest)",
}


def _forged(sources: Path, name: str, tmp_path: Path) -> Path:
    source, mutation = name.split("/")
    root, outside = tmp_path / "checkpoint", tmp_path / "outside"
    shutil.copytree(sources / source, root)
    shutil.copytree(sources / source, outside)
    catalogue(source)[mutation].edit(Context(root, outside, tmp_path / "ran", random.Random(0)))
    return root


@pytest.mark.parametrize("name", sorted(FOUND))
def test_what_the_fuzzer_found_is_refused(sources: Path, tmp_path: Path, name: str) -> None:
    import zero_strategy as zs
    from zero_strategy import cli

    root = _forged(sources, name, tmp_path)
    expect = catalogue(name.split("/")[0])[name.split("/")[1]].expect
    assert expect is not None
    for load in (lambda: zs.consolidate(root), lambda: zs.convert(root, tmp_path / "dcp", "dcp"),
                 lambda: zs.write_consolidated(root, tmp_path / "m.safetensors")):
        with pytest.raises(zs.CheckpointError) as error:
            load()
        assert str(root) in str(error.value) and expect in str(error.value), FOUND[name]
    assert cli.main(["convert", str(root), str(tmp_path / "zero"), "--to", "zero"]) == 2
    assert not (tmp_path / "dcp").exists() and not (tmp_path / "zero").exists()
    assert not (tmp_path / "m.safetensors").exists()
