"""The worlds of tests/worlds/scenarios_save.py, run once per pytest session and shared by
tests/quick/test_save_streamed.py and tests/quick/test_hub_weights.py: starting a world that
imports transformers costs more than all its scenarios together."""

from __future__ import annotations

import functools

from tests.support.harness import run_world

WORLD = "tests/worlds/scenarios_save.py"
ONE_RANK = ["gpt2_stage3", "gpt2_indexed_stage1", "moe_stage3", "failure_leaves_nothing",
            "iter_gpt2_stage3_rank0", "iter_moe_stage3_all"]
"""What also runs on a single rank (every rank is the writer and the receiver there)."""


@functools.cache
def world(size: int) -> dict:
    env = {"ZS_ONLY": ",".join(ONE_RANK)} if size == 1 else None
    return run_world(WORLD, size, env=env)
