"""`python -m glm45v_fsdp.tools.compare-batches A B [--json]`, the documented command: runs compare_batches.py.

Python runs a module with a hyphenated name (`-m`) but cannot import one, so the code lives in compare_batches.py
(imported by the tests and usable as `-m glm45v_fsdp.tools.compare_batches` too) and this file only starts it.
"""

import sys

from glm45v_fsdp.tools.compare_batches import main

if __name__ == "__main__":
    sys.exit(main())
