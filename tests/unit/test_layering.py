"""The import rules (ARCHITECTURE.md, "Contracts"): api -> service -> workers, and service sees
only the ground layer of workers (the job spec, the driver protocol, the parallel shape, the
checkpoint layout and the metric catalog: pure modules without torch or Ray)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(package: str) -> list[tuple[str, str]]:
    """(file, imported module) for every import in a package, including imports inside functions."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((str(path.relative_to(ROOT)), node.module))
    return found


GROUND = (
    "workers.config",
    "workers.protocol",
    "workers.parallel_dims",
    "workers.checkpoint_layout",
    "workers.metrics",
)


def _top(module: str) -> str:
    return module.split(".")[0]


def test_workers_never_import_service_or_api() -> None:
    bad = [(f, m) for f, m in _imports("workers") if _top(m) in ("service", "api")]
    assert bad == []


def test_service_never_imports_api_and_only_workers_ground_layer() -> None:
    def forbidden(module: str) -> bool:
        return _top(module) == "api" or (_top(module) == "workers" and module not in GROUND)

    bad = [(f, m) for f, m in _imports("service") if forbidden(m)]
    assert bad == []


def test_the_rules_see_imports() -> None:
    """Guard against a scanner that finds nothing: the packages do import each other the allowed way."""
    assert any(m == "workers.config" for _, m in _imports("service"))
    assert any(_top(m) == "service" for _, m in _imports("api"))


def test_the_job_driver_starts_without_torch() -> None:
    """The per-job driver (`python -m workers.driver`) reserves, supervises and reports; the ranks
    train. Importing torch would cost every driver start seconds of CPU and hundreds of MB on the
    head, once per job and again per resubmission."""
    import subprocess
    import sys

    code = "import sys, workers.driver; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
