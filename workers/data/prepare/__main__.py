"""`python -m workers.data.prepare`: the command in `command.py`, run from the importable module
(Ray pickles the tasks' functions by module name)."""

import sys

from workers.data.prepare.command import main

sys.exit(main())
