"""`python -m workers.driver`: the per-job driver that the control plane starts as a Ray job.

The code lives in `workers.orchestration`; this module is the public entry point (SPEC §1).
"""

import sys

from workers.orchestration.driver import main

if __name__ == "__main__":
    sys.exit(main())
