"""`python -m glm45v_fsdp.tools.compare-batches A B [--json]`: see glm45v_fsdp.tools.compare_batches."""

import sys

from glm45v_fsdp.tools.compare_batches import main

if __name__ == "__main__":
    sys.exit(main())
