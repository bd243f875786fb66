"""Shared test configuration: make the repo importable in spawned processes, mark each test with its
tier (the first folder under tests/), skip GPU tests without CUDA.

Tiers mirror what a test needs, and folders below `unit/` mirror the code it tests:
`unit/<package>/` (one package, in-process or a few torch.distributed processes; no Ray cluster
except where the package itself runs on Ray; the dashboard in headless Chromium against a real
server in `unit/api/browser/`, marked `browser`), `integration/` (the control plane, a real Ray
head, drivers and ranks together), `deploy/` (manifests rendered offline), `multihost/` (network
namespaces). `make test-fast` runs `unit/` without slow tests.
Helpers shared by several modules live in `support/`."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONPATH", str(ROOT))
if "RINGTRAIN_DATA_CACHE" not in os.environ:  # kind: text corpora: one cache per run, not ~/.cache
    _data_cache = tempfile.mkdtemp(prefix="ringtrain-data-cache-")
    os.environ["RINGTRAIN_DATA_CACHE"] = _data_cache
    atexit.register(shutil.rmtree, _data_cache, True)

from tests.support.pg import postgres_server  # noqa: E402, F401  (session PostgreSQL server)
from tests.support.ray_fixtures import ray_head, report_receiver  # noqa: E402, F401  (session Ray head, report receiver)
from tests.support.require import missing  # noqa: E402


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's headless Chromium through Playwright, one per test module; skips only where the binary is missing."""
    from tests.support.browser_fixtures import CHROMIUM, CHROMIUM_ARGS, chromium_missing

    why = chromium_missing()
    if why:
        missing("chromium", why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


TIERS = ("unit", "integration", "deploy", "multihost")


def _on_the_cluster(item: pytest.Item) -> bool:
    """Tests that use the session's Ray head or start Ray themselves (`ray`, `multihost`)."""
    return any(item.get_closest_marker(m) is not None for m in ("ray", "multihost")) or (
        "ray_head" in getattr(item, "fixturenames", ())
    )


_UNGROUPED: list[str] = []  # tests whose xdist_group marker --dist loadgroup did not apply


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        _UNGROUPED[:] = [
            item.nodeid
            for item in session.items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid
        ]


@pytest.fixture(scope="session", autouse=True)
def _xdist_groups_apply() -> None:
    """make test's time budget counts on `xdist_group` (one multihost cluster, one MLflow server,
    one memory-plan launch per world size): every test errors at once where a pytest /
    pytest-xdist pair has stopped applying it (pytest 9.2 with xdist 3.8 drops it silently),
    instead of a suite that quietly builds everything twice."""
    if _UNGROUPED:
        raise pytest.UsageError(
            f"--dist loadgroup ignored the xdist_group marker of {len(_UNGROUPED)} test(s), "
            f"e.g. {_UNGROUPED[0]}: pytest {pytest.__version__} and this pytest-xdist disagree "
            "on node ids; install the versions pyproject.toml pins (pip install -e '.[dev]')"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.path)).relative_to(ROOT / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    if hasattr(config, "workerinput"):
        # A pytest-xdist worker (make test runs `-n auto`), where the suite's order is the order
        # work is handed out: the longest poles first (tests on Ray: a cluster, drivers, ranks;
        # then other slow ones), so that no worker is left with one at the end while the other
        # idles. Each worker has its own session Ray head (free ports, its own temp dir) and every
        # process a test kills is found by its job id, head temp dir or network namespace, so
        # tests on two workers never touch each other's processes.
        items.sort(
            key=lambda item: (not _on_the_cluster(item), item.get_closest_marker("slow") is None)
        )
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
