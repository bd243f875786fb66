"""RULER inside a training job: a sample's score is the share of its reference answers whose every
token the model predicts (teacher forcing), a length's score the mean over tasks, the effective
length the longest length at or above 0.856; the same on one process and on a ring of 2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.dist import run_distributed
from tests.support.trainutil import one_thread, tiny_spec
from workers.config import JobSpec
from workers.data.tokenizer import ByteTokenizer
from workers.evals.ruler import TASKS
from workers.training.evals import EVAL_SALT

assert one_thread  # autouse fixture, imported to apply to this module

LENGTHS = [2048, 4096]


class Oracle(nn.Module):
    """Knows every window: predicts the true next token, except where told to miss (per length:
    every answer token; or, per task, the tokens of one answer)."""

    def __init__(self, spec: JobSpec, miss_length: int, miss: dict[str, int]) -> None:
        super().__init__()
        self.ring = spec.parallel.ring_size  # a shard is 1/ring of its window (noise repeats)
        from workers.training.ruler_eval import ruler_window

        self.windows: list[tuple[torch.Tensor, torch.Tensor]] = []
        seed = spec.train.seed ^ EVAL_SALT
        for length in LENGTHS:
            for task in TASKS:
                window, weights, _ = ruler_window(ByteTokenizer(), task, length, 0, seed)
                target = window[1:].clone()
                if length == miss_length:
                    target[weights > 0] = (target[weights > 0] + 1) % 256
                elif task in miss:
                    on = weights == miss[task] + 1
                    first = int(on.nonzero()[0])
                    target[first] = (target[first] + 1) % 256  # one token of that answer wrong
                self.windows.append((window[:-1], target))

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = []
        for row in inputs:
            found = [
                t
                for w, t in self.windows
                if len(w) == len(row) * self.ring and torch.equal(w[positions], row)
            ]
            assert len(found) == 1, "each window is known"
            rows.append(nn.functional.one_hot(found[0][positions], 256).float())
        return torch.stack(rows)


def _spec(ring: int) -> JobSpec:
    return tiny_spec(
        data={"seq_len": 2048},
        parallel={"ring_size": ring},
        eval={"suites": ["ruler"], "context_lengths": LENGTHS, "samples": 1},
    )


def _scores(rank: int, world: int, ring: int) -> dict[str, float]:
    from workers.parallel_dims import ParallelDims
    from workers.training.mesh import build_mesh
    from workers.training.ruler_eval import ruler_scores

    spec = _spec(ring)
    mesh = build_mesh(ParallelDims.of(spec.parallel), "cpu")
    oracle = Oracle(spec, miss_length=4096, miss={"niah_multivalue": 1, "vt": 0})
    return ruler_scores(oracle, spec, mesh, torch.device("cpu"))


@pytest.mark.multiprocess
def test_scores_follow_the_rule_on_one_process_and_on_a_ring() -> None:
    one = run_distributed(_scores, 1, 1)[0]
    want_tasks = {t: 1.0 for t in TASKS}
    want_tasks["niah_multivalue"] = 3 / 4  # one of its four values missed
    for task, score in want_tasks.items():
        if task != "vt":
            assert one[f"ruler/{task}/len=2048"] == pytest.approx(score), task
        assert one[f"ruler/{task}/len=4096"] == 0.0, task
    vt = one["ruler/vt/len=2048"]
    assert 0 < vt < 1  # one of its chain's names missed
    assert one["ruler/len=2048"] == pytest.approx((6 + 0.75 + vt) / 8)
    assert one["ruler/len=4096"] == 0.0
    assert one["effective_length"] == 2048.0
    two = run_distributed(_scores, 2, 2)
    assert two[0] == two[1] == pytest.approx(one)


def test_a_window_marks_exactly_each_answers_tokens() -> None:
    """Label t predicts token t + 1: the labels weighing j + 1 spell answer j, and nothing after the
    answers weighs anything (padding)."""
    from workers.evals.ruler import make_sample
    from workers.training.ruler_eval import ruler_window

    tok = ByteTokenizer()
    for task in TASKS:
        window, weights, count = ruler_window(tok, task, 2048, 3, 11)
        sample = make_sample(tok, task, 2048 + 1 - TASKS[task][1], 3, 11)
        assert count == len(sample.answers) >= 1
        labels = window[1:]
        for j, answer in enumerate(sample.answers):
            assert tok.decode(labels[weights == j + 1]) == answer, (task, j)
        last = int((weights > 0).nonzero().max())
        assert (weights[last + 1 :] == 0).all() and (window[last + 2 :] == 0).all()
        prompt = tok.encode(sample.prompt)
        assert (
            window[: len(prompt)].tolist() == prompt and int(weights[: len(prompt) - 1].sum()) == 0
        )
