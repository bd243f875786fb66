"""`python -m api.cli`: the `ringtrain` command."""

import sys

from api.cli import main

sys.exit(main())
