"""What a job evaluates follows its data unless the spec says otherwise: the passkey grid on
passkey data, held-out loss on corpora (never a retrieval grid a corpus job was not trained for);
suites that cannot run in the job are refused naming `eval.suites.<i>`."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.support.trainutil import one_thread, tiny_spec
from workers.protocol import MetricPoint
from workers.training.trainer import Trainer

assert one_thread  # autouse fixture, imported to apply to this module

CORPUS = "\n".join(f"Document {i}: the river runs past the garden {i} times." for i in range(60))


def _evaluated(spec) -> set[str]:  # type: ignore[no-untyped-def]
    points: list[MetricPoint] = []
    Trainer(spec, checkpoint_dir=None, emit=points.append).evaluate()
    return {p.name.split("/")[0] for p in points}


def test_the_default_suite_follows_the_data(tmp_path: Path) -> None:
    on = {"enabled": True, "samples": 1}  # the tiny job's eval is off by default
    passkey = tiny_spec(data={"seq_len": 128}, eval=on)
    assert passkey.eval_suites() == ["passkey"] and _evaluated(passkey) == {
        "passkey_acc",
        "passkey_token_acc",
    }
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    text = tiny_spec(data={"kind": "text", "path": str(corpus), "seq_len": 128}, eval=on)
    assert text.eval_suites() == ["val"]
    assert not {n for n in _evaluated(text) if n.startswith("passkey")}
    both = tiny_spec(
        data={"kind": "text", "path": str(corpus), "seq_len": 128},
        eval={**on, "suites": ["passkey", "val", "passkey"]},
    )
    assert both.eval_suites() == ["passkey", "val"] and "passkey_acc" in _evaluated(both)


@pytest.mark.parametrize(
    ("suites", "data", "words"),
    [
        (["passkey", "val"], {"seq_len": 128}, "held-out documents"),
        (["needle"], {"seq_len": 128}, "passkey"),
        ([], {"seq_len": 128}, "at least 1"),
    ],
)
def test_suites_that_cannot_run_are_refused_naming_the_field(
    suites: list[str], data: dict, words: str
) -> None:
    with pytest.raises(ValidationError) as e:
        tiny_spec(data=data, eval={"suites": suites})
    err = e.value.errors()[0]
    assert err["loc"][:2] == ("eval", "suites") and words in err["msg"], err


def test_ruler_needs_room_for_every_task_at_each_length() -> None:
    with pytest.raises(ValidationError) as e:
        tiny_spec(data={"seq_len": 128}, eval={"suites": ["ruler"]})
    err = e.value.errors()[0]
    assert err["loc"] == ("data", "seq_len") and "at least 2048" in err["msg"], err
    with pytest.raises(ValidationError) as e:
        tiny_spec(eval={"suites": ["ruler"], "context_lengths": [4096, 1024]})
    assert e.value.errors()[0]["loc"] == ("eval", "context_lengths", 1)
    ok = tiny_spec(eval={"suites": ["ruler", "passkey"], "context_lengths": [2048]})
    assert ok.eval_suites() == ["ruler", "passkey"]
