"""Helpers for the dashboard's browser tests: headless Chromium through Playwright (Python), a real uvicorn
server on a loopback port with a temporary SQLite store (tests/api_harness), console-error capture, and
screenshots under test-artifacts/."""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from tests.support.api_harness import ALICE, Driver, Server

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN_KEY = "ringtrain.token"


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here (the system's Chromium is absent), or None. The playwright package
    is a dev dependency of this project: its import failing is a broken environment and fails the tests."""
    if not Path(CHROMIUM).exists():
        return f"Chromium not found at {CHROMIUM} (apt-get install -y chromium)"
    return None


class PageErrors:
    """Console errors and uncaught exceptions of one page; `allow` takes regexes of expected messages."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.allowed: list[re.Pattern[str]] = []

    def allow(self, pattern: str) -> None:
        self.allowed.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        return [m for m in self.messages if not any(p.search(m) for p in self.allowed)]


def capture_errors(pg: Any) -> PageErrors:
    """Collect the page's console errors and uncaught exceptions (as `pg.errors`) for a test to fail on."""
    errs = PageErrors()
    pg.on(
        "console",
        lambda m: (
            errs.messages.append(f"console.{m.type}: {m.text}") if m.type == "error" else None
        ),
    )
    pg.on("pageerror", lambda e: errs.messages.append(f"pageerror: {e}"))
    pg.errors = errs
    return errs


def shot(page: Any, name: str, full_page: bool = True) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    p = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(p), full_page=full_page)
    return p


def create_job(srv: Server, spec: dict[str, Any], token: str = ALICE) -> dict[str, Any]:
    with srv.client(token) as c:
        r = c.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return r.json()


def placement(
    ranks: int, nodes: tuple[str, ...] = ("node-a", "node-b"), gpu: bool = True
) -> list[dict[str, Any]]:
    per = -(-ranks // len(nodes))
    out = []
    for r in range(ranks):
        node = nodes[r // per]
        out.append(
            {
                "rank": r,
                "node_id": node,
                "node_ip": f"10.0.0.{nodes.index(node) + 1}",
                "device": f"cuda:{r % per}" if gpu else "cpu",
                "ring": 0,
            }
        )
    return out


def start_running(srv: Server, job_id: str, ranks: int = 4, **kw: Any) -> Driver:
    """Play the driver: PLACING → RUNNING with a placement over two nodes."""
    d = Driver(srv, job_id)
    assert d.state("PLACING", reason="reserving 4 bundles").status_code == 200
    r = d.state(
        "RUNNING",
        reason=f"all {ranks} ranks placed",
        placement=placement(ranks, **kw),
        metadata={"backend": "nccl", "kernel": "flash"},
    )
    assert r.status_code == 200, r.text
    return d


def step_items(
    d: Driver, step: int, ranks: int = 4, loss: float | None = None
) -> list[dict[str, Any]]:
    loss = loss if loss is not None else 6.0 * (0.98**step) + 0.05 * ((step * 7919) % 13) / 13
    items = [
        d.item("metric", step=step, name="loss", value=loss),
        d.item("metric", step=step, name="lr", value=3e-4 * min(1.0, (step + 1) / 20)),
        d.item("metric", step=step, name="grad_norm", value=1.0 / (1 + step) + 0.3),
        d.item("metric", step=step, name="tokens_per_s", value=52000 + 900 * ((step * 31) % 7)),
        d.item("metric", step=step, name="step_time_s", value=0.31 + 0.02 * ((step * 17) % 5)),
    ]
    items += [
        d.item(
            "metric",
            step=step,
            name="mem_peak_bytes",
            value=(3.1 + 0.2 * r) * 2**30 + step * 2**20,
            rank=r,
        )
        for r in range(ranks)
    ]
    return items


class Feeder:
    """Streams training steps to the job from a thread (like a running driver), until stopped. A failure of the
    feeder (an exception, or an answer other than 200) stops it and is raised when the `with` block ends, so a
    test never passes on a dashboard that silently stopped receiving data."""

    def __init__(self, d: Driver, start: int, every_s: float = 0.2, ranks: int = 4) -> None:
        self.d, self.step, self.every_s, self.ranks = d, start, every_s, ranks
        self.stop_evt = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.error: BaseException | None = None
        self.posts = 0

    def run(self) -> None:
        try:
            while not self.stop_evt.is_set():
                r = self.d.post(
                    [
                        *step_items(self.d, self.step, self.ranks),
                        self.d.item("log", source="driver", line=f"step {self.step} loss ok"),
                    ]
                )
                if r.status_code != 200:
                    raise FeederError(
                        f"report for step {self.step} answered HTTP {r.status_code}: {r.text[:300]}"
                    )
                self.posts += 1
                self.step += 1
                self.stop_evt.wait(self.every_s)
        except BaseException as e:  # raised by stop()
            self.error = e

    def stop(self) -> None:
        """Stop feeding; raise what made the feeder fail, if anything did."""
        self.stop_evt.set()
        self.thread.join(timeout=30)
        if self.thread.is_alive():
            raise FeederError("the feeder did not stop within 30 s (a report request hangs)")
        if self.error is not None:
            raise FeederError(
                f"the feeder failed after {self.posts} reports: {self.error!r}"
            ) from self.error

    def __enter__(self) -> Feeder:
        self.thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.stop()
        else:  # the test already fails: stop quietly, keep its error
            self.stop_evt.set()
            self.thread.join(timeout=30)


class FeederError(AssertionError):
    """The feeder could not deliver a step: the dashboard under test was not being fed."""


def wait_js(page: Any, expression: str, arg: Any = None, timeout: float = 30000) -> Any:
    """Poll a JavaScript expression (or function of `arg`) until it is truthy; return its value.

    Playwright's `wait_for_function` compiles the predicate with `eval` inside the page, which the dashboard's CSP
    (`script-src 'self'`, no 'unsafe-eval') refuses as soon as the predicate is not already true on its first
    try. Each `page.evaluate` is a fresh DevTools evaluation that the CSP does not apply to, so this polls from
    Python instead. An evaluation that throws (the page is navigating, an element is not there yet) counts as
    not-yet; the last error is in the timeout's message."""
    deadline = time.monotonic() + timeout / 1000
    last: str = "never evaluated"
    while True:
        try:
            value = page.evaluate(expression, arg)
            if value:
                return value
            last = f"last value {value!r}"
        except (
            Exception
        ) as e:  # playwright.sync_api.Error: context destroyed by a reload, TypeError in the page
            last = f"last error {type(e).__name__}: {str(e)[:300]}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{expression!r} not true within {timeout / 1000:g} s ({last})")
        time.sleep(0.05)
