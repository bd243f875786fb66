"""Skip where a system dependency is missing, but fail under CI.

A test that needs something outside Python (kubectl, PostgreSQL's server binaries, Chromium, Node.js) skips on a
developer's machine that lacks it. `.ci/run` installs all of them and sets `RINGTRAIN_REQUIRE_<NAME>=1`,
so there a lost install step fails the tests instead of passing as a row of skips.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(name: str, why: str) -> NoReturn:
    """Skip with `why`, or fail with it where RINGTRAIN_REQUIRE_<NAME>=1."""
    var = f"RINGTRAIN_REQUIRE_{name.upper()}"
    if os.environ.get(var) == "1":
        pytest.fail(f"{why} ({var}=1)")
    pytest.skip(why)
