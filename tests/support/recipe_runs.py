"""What the recipe tests of both tiers share: composing ``conf/`` against the schema, running
``recipes/train.py`` as a user does, and the overrides that make a job take seconds."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from recipes import schema

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
# A job of a few seconds: the tiny model, the fast trainer preset, 6 optimizer steps.
FAST = ("trainer=fast", "model.size=tiny", "trainer.max_steps=6")

schema.register()

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (the optional extra: pip install -e '.[anchors]')")


def compose_config(overrides: list[str]):  # noqa: ANN201
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def run_train(*args: str, cwd: Path, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "recipes" / "train.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**os.environ, **(env or {})})


def fast_sweep(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """A sweep of DDP, FSDP and stage 3 as real 2-process jobs of 6 steps; (its directory, the
    run). Checkpoints every 2 steps; each job keeps its step-4 one (a test seam), which a job
    of another strategy resumes (tests/integration/test_recipe_jobs.py)."""
    sweep = tmp_path / "sweep"
    run = run_train("-m", "strategy=ddp,fsdp,zero3", *FAST, "trainer.checkpoint_every=2",
                    f"hydra.sweep.dir={sweep}", cwd=tmp_path, env={"ZS_CHECKPOINT_COPY_AT": "4"})
    return sweep, run
