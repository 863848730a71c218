"""Streaming pretrained weights into the shards at a size where it matters: a 24-layer GPT-2
(about 330 MB in fp32) at N=2 and an 8-layer one at N=4, stage 3; each rank's peak RSS growth
while ``from_pretrained`` + ``ZeroEngine`` run, against ``Model.from_pretrained`` + the engine.
The quick tier runs a 6-layer one at N=2 (tests/quick/test_pretrained.py). About 2 minutes."""

from __future__ import annotations

import pytest

from tests.support.harness import check, run_world


@pytest.mark.parametrize("world, layers", [(2, 24), (4, 8)])
def test_peak_memory_is_a_shard_not_the_model(world: int, layers: int) -> None:
    """The bound and its constant are argued in the quick tier's test of the same name."""
    results = run_world("tests/worlds/pretrained_memory.py", world,
                        env={"MALLOC_MMAP_THRESHOLD_": "65536",
                             "ZS_PRETRAINED_LAYERS": str(layers)})
    for rank, r in enumerate(check(results["peak_rss"])):
        where = f"N={world} rank {rank}: {r}"
        print(where)
        assert r["same_weights"], where
        assert r["whole_mib"] > 0.95 * r["model_mib"], f"the measurement cannot tell: {where}"
        assert r["streamed_mib"] <= r["shard_mib"] + r["largest_unit_mib"] + 16, where
        assert r["streamed_mib"] < r["model_mib"] * (0.8 if world == 2 else 0.5), where
