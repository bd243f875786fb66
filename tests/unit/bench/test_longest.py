"""The pure parts of `bench/longest.py`: the search over lengths, the planner's starting point."""

from __future__ import annotations

import pytest

from bench.longest import longest_under, oom_kills, round_down, search


def probe(limit: int) -> tuple[list[int], object]:
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= limit

    return tried, fits


@pytest.mark.parametrize("start", [256, 3000, 4096, 9000, 50_000])
@pytest.mark.parametrize("grow", [2.0, 1.25])
def test_search_brackets_the_limit_to_the_resolution(start: int, grow: float) -> None:
    tried, fits = probe(7000)
    ok, bad = search(fits, start, 256, grow=grow, resolution=8)  # type: ignore[arg-type]
    assert ok is not None and bad is not None
    assert ok <= 7000 < bad
    assert bad - ok <= max(256, ok // 8)
    assert all(n % 256 == 0 for n in tried)
    assert ok in tried and bad in tried  # both ends were measured, not inferred
    assert len(tried) == len(set(tried))


def test_search_from_a_good_start_takes_few_runs() -> None:
    tried, fits = probe(7000)
    search(fits, 6400, 256, grow=1.25, resolution=8)  # type: ignore[arg-type]
    assert len(tried) == 3


def test_search_edges() -> None:
    _, nothing = probe(100)
    assert search(nothing, 1024, 256) == (None, 256)  # type: ignore[arg-type]
    _, everything = probe(1 << 30)
    assert search(everything, 1024, 256, limit=4096) == (4096, None)  # type: ignore[arg-type]


def test_longest_under_and_rounding() -> None:
    assert longest_under(lambda n: 100 + 2 * n, 10_100, 256, 1 << 20) == 4864
    assert longest_under(lambda n: 1e9, 10, 256, 1 << 20) == 256
    assert longest_under(lambda n: 0, 10, 256, 5000) == 4864
    assert round_down(1000, 256) == 768 and round_down(10, 256) == 256


def test_oom_kills_reads_the_v1_file() -> None:
    assert oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n") == 2
    assert oom_kills("oom_kill_disable 0\nunder_oom 0\n") == 0
