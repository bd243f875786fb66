"""RULER-style tasks: every sample is answerable from its prompt (a reference solver reads the
answers back out of the text), is built to its length in the model's own tokens, and depends only
on (task, length, index, seed); scores and effective length follow RULER's rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hf_fixtures import write_checkpoint
from workers.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from workers.evals.ruler import NEEDLE_RE, TASKS, make_sample, solve
from workers.evals.scoring import THRESHOLD, effective_length, score, summarize


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "bytes":
        return ByteTokenizer()
    path = write_checkpoint(tmp_path_factory.mktemp("bpe"), "llama")
    return load_tokenizer(str(Path(path)))


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("length", [1024, 3000])
def test_each_sample_is_answerable_at_its_length(tok: Tokenizer, task: str, length: int) -> None:
    for index in range(2):
        s = make_sample(tok, task, length, index, seed=3)
        n = len(tok.encode(s.prompt))
        assert 0.9 * length <= n <= length, (task, length, n)
        solved = solve(task, s.prompt)
        if task == "cwe":  # ten words tied at the top count: their order is not the answer
            assert sorted(solved) == sorted(s.answers) and len(s.answers) == 10
        else:
            assert solved == s.answers and s.answers, (task, solved, s.answers)
        assert score(" ".join(s.answers), s.answers) == 1.0
        assert s.max_new_tokens > 0 and (s.task, s.length, s.index) == (task, length, index)


def test_needle_tasks_hold_what_they_say() -> None:
    tok = ByteTokenizer()
    multikey = make_sample(tok, "niah_multikey", 2048, 0)
    assert len(NEEDLE_RE.findall(multikey.prompt)) == 4 and len(multikey.answers) == 1
    multivalue = make_sample(tok, "niah_multivalue", 2048, 0)
    needles = NEEDLE_RE.findall(multivalue.prompt)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 1
    assert [v for _, v in needles] == multivalue.answers
    multiquery = make_sample(tok, "niah_multiquery", 2048, 0)
    assert len(multiquery.answers) == 4
    # the needle sits at a different depth in different samples
    depths = {
        make_sample(tok, "niah_single_noise", 2048, i).prompt.find("special magic numbers for")
        for i in range(6)
    }
    assert len(depths) > 3


def test_samples_depend_only_on_task_length_index_and_seed() -> None:
    tok = ByteTokenizer()
    a = make_sample(tok, "vt", 2048, 1, seed=5)
    assert make_sample(tok, "vt", 2048, 1, seed=5) == a
    assert make_sample(tok, "vt", 2048, 2, seed=5).prompt != a.prompt
    assert make_sample(tok, "vt", 2048, 1, seed=6).prompt != a.prompt


def test_bad_task_and_too_short_length_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_sample(ByteTokenizer(), "nope", 1024, 0)
    with pytest.raises(ValueError, match="length 64 is too short"):
        make_sample(ByteTokenizer(), "cwe", 64, 0)


def test_score_is_the_share_of_references_found_ignoring_case() -> None:
    assert score("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert score("the NUMBER is 123", ["123", "456", "789", "101"]) == 0.25
    assert score("Bridge, RIVER", ["river", "bridge", "valley"]) == pytest.approx(2 / 3)
    assert score("", ["1"]) == 0.0
    with pytest.raises(ValueError):
        score("x", [])


def test_summary_means_by_task_then_length_and_effective_length() -> None:
    records = [
        {"task": "a", "length": 4096, "score": 1.0},
        {"task": "a", "length": 4096, "score": 0.5},  # a: 0.75 at 4096
        {"task": "b", "length": 4096, "score": 1.0},  # b: 1.0 -> 4096: 0.875
        {"task": "a", "length": 8192, "score": 1.0},
        {"task": "b", "length": 8192, "score": 0.5},  # 8192: 0.75
        {"task": "a", "length": 2048, "score": 0.9},
        {"task": "b", "length": 2048, "score": 0.9},  # 2048: 0.9
    ]
    report = summarize(records)
    assert report["tasks"]["a"] == {"2048": 0.9, "4096": 0.75, "8192": 1.0}
    assert report["by_length"] == pytest.approx({"2048": 0.9, "4096": 0.875, "8192": 0.75})
    assert report["effective_length"] == 4096 and report["threshold"] == THRESHOLD == 0.856
    assert effective_length({"1024": 0.5}) == 0
    assert effective_length({"512": THRESHOLD, "1024": 0.85}) == 512  # at the threshold counts
    assert effective_length({"1024": 0.9, "2048": 0.86}, threshold=0.87) == 1024
