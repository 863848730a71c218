"""The two tiers: a test's folder is its tier.

``tests/quick`` is what ``python -m pytest`` runs (pyproject's ``testpaths``): every layer at
its smallest, in minutes. ``tests/integration`` holds what starts real jobs, clusters and
interpreters; ``.ci/run`` runs it after the quick tier. Each item is marked with its tier, so
``-m integration`` / ``-m "not integration"`` select across a run of ``tests/`` as a whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _INTEGRATION in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.integration)
