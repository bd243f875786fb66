"""`ringtrain eval` end to end on a tiny checkpoint: one process and a ring of two give the same
predictions, the report has RULER's shape and its numbers are the samples' scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.cli import main
from tests.support.hf_fixtures import write_checkpoint
from workers.evals.ruler import solve
from workers.evals.scoring import score, summarize

TASKS = "niah_single_noise,vt"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("m"), "llama", max_position_embeddings=2048)


def _run(capsys: pytest.CaptureFixture[str], model: Path, out: Path, ring: int) -> dict:
    argv = ["eval", str(model), "--lengths", "512,768", "--samples", "1", "--tasks", TASKS]
    argv += ["--ring-size", str(ring), "--samples-out", str(out), "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_eval_on_one_and_two_ranks(capsys, model_dir: Path, tmp_path: Path) -> None:
    one = _run(capsys, model_dir, tmp_path / "one.jsonl", 1)
    two = _run(capsys, model_dir, tmp_path / "two.jsonl", 2)
    lines = [json.loads(x) for x in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 1  # tasks x lengths x samples
    keys = {"task", "length", "index", "prompt", "prompt_tokens", "answers", "prediction"}
    assert all(keys | {"score", "max_new_tokens"} == set(r) for r in lines)
    for r in lines:
        assert r["prompt_tokens"] <= r["length"] + 1  # + BOS where the tokenizer has one
        assert solve(r["task"], r["prompt"]) == r["answers"]
        assert r["score"] == score(r["prediction"], r["answers"])
    ring = [json.loads(x) for x in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [r["prediction"] for r in ring] == [r["prediction"] for r in lines]
    assert one == two == summarize(lines)
    assert set(one["tasks"]) == set(TASKS.split(",")) and set(one["by_length"]) == {"512", "768"}


def test_bad_arguments_say_what_is_wrong(capsys, tmp_path: Path) -> None:
    assert main(["eval", str(tmp_path), "--lengths", "300", "--ring-size", "0"]) == 2
    assert "--ring-size must be >= 1" in capsys.readouterr().err
