"""The differential harness's cases as scenarios of one world (tests/harness.py): which cases
is read from the environment (tests/space.py ``cases_from_env``)."""

from __future__ import annotations

import os

from tests.harness import register
from tests.space import case_name, cases_from_env, run_case

for _case in cases_from_env():
    register(case_name(_case), run_case, case=_case, directory=os.environ["ZS_SPACE_DIR"])
