"""Ray Train on the engine: checkpoints reported to Ray by every worker, each its own files
(``report.py``); Lightning's and transformers' parts in ``lightning.py`` and ``hf.py``, each
importing only its own framework."""

from .report import Reported, owned_files, report, restore, save_and_report

__all__ = ["Reported", "owned_files", "report", "restore", "save_and_report"]
