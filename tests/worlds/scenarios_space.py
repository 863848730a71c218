"""The differential harness's cases as scenarios of one world (tests/support/harness.py):
which cases is read from the environment (tests/support/space.py ``cases_from_env``)."""

from __future__ import annotations

import os

from tests.support.harness import register
from tests.support.space import case_name, cases_from_env, run_case

for _case in cases_from_env():
    register(case_name(_case), run_case, case=_case, directory=os.environ["ZS_SPACE_DIR"])
