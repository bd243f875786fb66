"""Every benchmark still imports: they share helpers with the tests (`tests.support`), and a
reorganised test tree once left six of them pointing at modules that no longer existed."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import bench

MODULES = sorted(m.name for m in pkgutil.iter_modules(bench.__path__))


def test_the_benchmarks_are_found() -> None:
    assert {"attention", "memory", "tensor_parallel", "train"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports(name: str) -> None:
    module = importlib.import_module(f"bench.{name}")
    assert module.__doc__, f"bench/{name}.py says what it measures in its docstring"
