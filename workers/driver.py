"""`python -m workers.driver`: the per-job driver that the control plane starts as a Ray job.

The code lives in `workers.orchestration`; this is the public entry point (ARCHITECTURE.md).
"""

import sys

from workers.orchestration.driver import main

if __name__ == "__main__":
    sys.exit(main())
