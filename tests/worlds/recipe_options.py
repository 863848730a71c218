"""Every value of every config group of the recipes, composed with the defaults and run as a
real 2-process job for 2 steps on ``model.size=tiny`` (or refused before any worker starts),
for tests/integration/test_recipe_options.py; options that compose to the same job (each group's
default) run it once. One interpreter composes with Hydra's compose API and runs
the jobs one after another through the recipes' own ``launch.run_job`` (preloaded, forked
workers): a Hydra process per group would spend most of the time starting.

    python tests/worlds/recipe_options.py OUT        # writes OUT/options.json
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"

GROUPS = ("strategy", "precision", "model", "data", "optim", "trainer", "experiment",
          "hparams_search")
SHORT = ("model.size=tiny", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "trainer.limit_val_batches=1", "trainer.checkpoint_every=0", "trainer.devices=2",
         "trainer.progress_bar=false", "data.batch_size=2")


def options() -> list[tuple[str, str]]:
    return [(group, p.stem) for group in GROUPS for p in sorted((CONF / group).glob("*.yaml"))]


def main(out: Path) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipes import launch, schema

    schema.register()
    results: list[dict] = []
    ran: dict[str, dict] = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for group, option in options():
            record: dict = {"group": group, "option": option}
            try:
                cfg = compose(config_name="config", overrides=[f"{group}={option}", *SHORT])
                launch.check_job(cfg)
            except Exception as e:  # refused at compose time: the test reads the message
                record.update(status="refused", message=f"{type(e).__name__}: {e}")
                results.append(record)
                continue
            key = OmegaConf.to_yaml(cfg, resolve=True)
            if key in ran:  # the same job as another option's (a group's default): once
                record.update({**ran[key], "group": group, "option": option})
                results.append(record)
                continue
            job = out / f"{group}-{option}"
            try:
                launch.run_job(cfg, out=job)
                metrics = json.loads((job / "metrics.json").read_text())
                record.update(status="ran", steps=metrics["steps"],
                              first_loss=metrics["first_loss"],
                              train_loss=metrics["train_loss"], strategy=metrics["strategy"],
                              precision=metrics["precision"], model=cfg.model.name,
                              data=cfg.data.kind, world_size=metrics["world_size"],
                              optim=OmegaConf.select(cfg, "optim.name"))
            except Exception:  # a job that fails once its workers run: the test fails it
                record.update(status="failed", message=traceback.format_exc()[-3000:])
            results.append(record)
            ran[key] = record
            (out / "options.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
