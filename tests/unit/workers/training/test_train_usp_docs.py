"""Ulysses × ring and packed documents through the whole trainer, native and pretrained models: the same
loss curve as one process.

USP (ulysses 2; ulysses 2 × ring 2, zigzag and striped; ulysses 2 × data-parallel 2) and `data.pack: documents`
on any layout change only where tokens are computed, never the math: fp32 loss within 1e-5 relative, as in
tests/unit/workers/training/test_train_equivalence.py. The packed-document reference is made to
differ from the windows run
(documents stop attending to each other), so the equality below can fail.
"""

from __future__ import annotations

import pytest

from tests.support.dist import run_distributed
from tests.support.trainutil import one_thread, series, tiny_spec, train

assert one_thread  # autouse fixture, imported to apply to this module

K = 3
RTOL = 1e-5
DOCS = "\n".join(
    [
        f"document {i}: " + " ".join(f"w{(i * 7 + j) % 23}" for j in range(5 + 9 * (i % 5)))
        for i in range(40)
    ]
)


def _usp(**parallel: object) -> str:
    return tiny_spec(
        parallel={"ring_size": 1, "data_parallel": 1, "layout": "zigzag", **parallel}
    ).model_dump_json()


def _docs(tmp_path, pack: str, **parallel: object) -> str:
    corpus = tmp_path / "docs.jsonl"
    if not corpus.exists():
        import json

        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS.splitlines()))
    return tiny_spec(
        data={"kind": "text", "path": str(corpus), "seq_len": 96, "pack": pack},
        parallel={"ring_size": 1, "data_parallel": 1, "layout": "zigzag", **parallel},
    ).model_dump_json()


def _run_all(rank: int, world: int, specs: list[str]) -> list[list[float]]:
    return [series(train(rank, world, s, None, K)["points"], "loss") for s in specs]


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == K, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ulysses_and_packed_documents_match_one_process(tmp_path) -> None:
    usp_ref = series(train(0, 1, _usp(), None, K)["points"], "loss")
    docs_ref = series(train(0, 1, _docs(tmp_path, "documents"), None, K)["points"], "loss")
    windows_ref = series(train(0, 1, _docs(tmp_path, "windows"), None, K)["points"], "loss")
    assert usp_ref[-1] < usp_ref[0] and docs_ref[-1] < docs_ref[0]  # it learns: not a zero test
    assert _close(docs_ref, windows_ref) > 1e-3  # packing really changes what attends to what

    two = run_distributed(
        _run_all, 2, [_usp(ulysses_size=2), _docs(tmp_path, "documents", ring_size=2)]
    )[0]
    three = run_distributed(
        _run_all, 3, [_docs(tmp_path, "documents", ring_size=3, layout="striped")]
    )[0]
    four = run_distributed(
        _run_all,
        4,
        [
            _usp(ulysses_size=2, ring_size=2),
            _usp(ulysses_size=2, ring_size=2, layout="striped"),
            _usp(ulysses_size=2, data_parallel=2),
            _docs(tmp_path, "documents", ulysses_size=2, ring_size=2),
        ],
    )[0]
    got = {
        "usp u2": _close(two[0], usp_ref),
        "usp u2 x ring2 zigzag": _close(four[0], usp_ref),
        "usp u2 x ring2 striped": _close(four[1], usp_ref),
        "usp u2 x dp2": _close(four[2], usp_ref),
        "docs ring2 zigzag": _close(two[1], docs_ref),
        "docs ring3 striped": _close(three[0], docs_ref),
        "docs u2 x ring2": _close(four[3], docs_ref),
    }
    print("MEASURED relative loss difference:", got)
    assert max(got.values()) <= RTOL, got


def test_bad_ulysses_size_names_the_field() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:  # 4 query heads over 3 Ulysses ranks
        tiny_spec(parallel={"ulysses_size": 3}, data={"seq_len": 198})
    assert e.value.errors()[0]["loc"] == ("parallel", "ulysses_size")
    with pytest.raises(
        ValidationError
    ) as e:  # zigzag ring 2 (4 chunks) × ulysses 2 (2 pieces per shard): % 4
        tiny_spec(parallel={"ulysses_size": 2, "ring_size": 2}, data={"seq_len": 198})
    assert e.value.errors()[0]["loc"] == ("data", "seq_len")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pretrained_model_on_ulysses_matches_one_process(tmp_path) -> None:
    """A transformers checkpoint (Qwen2, GQA 4/2 heads, q/k/v biases) on Ulysses 2 and Ulysses 2 × ring 2:
    its heads go through the all-to-all inside transformers' own attention modules."""
    from tests.support.hf_fixtures import write_checkpoint

    model_dir, corpus = tmp_path / "qwen2", tmp_path / "corpus.txt"
    write_checkpoint(model_dir, "qwen2")
    corpus.write_text(DOCS)

    def spec(**parallel: object) -> str:
        return tiny_spec(
            model={"kind": "hf", "path": str(model_dir)},
            data={"kind": "text", "path": str(corpus), "seq_len": 96},
            parallel={"ring_size": 1, "data_parallel": 1, "layout": "zigzag", **parallel},
        ).model_dump_json()

    ref = series(train(0, 1, spec(), None, K)["points"], "loss")
    assert ref[-1] < ref[0]
    two = run_distributed(_run_all, 2, [spec(ulysses_size=2)])[0]
    four = run_distributed(_run_all, 4, [spec(ulysses_size=2, ring_size=2)])[0]
    got = {"u2": _close(two[0], ref), "u2 x ring2": _close(four[0], ref)}
    print("MEASURED relative loss difference (pretrained):", got)
    assert max(got.values()) <= RTOL, got
