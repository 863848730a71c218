"""Print the complete example (a block marked ``<!-- test: ... -->``) of a docs page, for
.ci/run to run in an environment without pytest: ``python .ci/example.py README.md``."""

import re
import sys
from pathlib import Path

BLOCK = re.compile(r"<!-- test: [^>]*? -->\n```python\n(.*?)```", re.S)

blocks = BLOCK.findall(Path(sys.argv[1]).read_text())
if len(blocks) != 1:
    raise SystemExit(f"{sys.argv[1]}: expected one complete example, found {len(blocks)}")
sys.stdout.write(blocks[0])
