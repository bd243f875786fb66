"""Greedy generation over a ring (ring prefill, pass-Q decoding) against transformers' own
`generate` on the same tiny checkpoint: the same tokens on 1, 2 and 3 ranks, every layout, a
prompt length no layout divides (its pads are never attended), GQA and q/k/v biases (qwen2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.hf_fixtures import write_checkpoint

NEW = 12
PROMPT_LEN = 37  # no layout's multiple on 2 or 3 ranks: pads at the end on every ring


def _prompt(vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(1, vocab, (PROMPT_LEN,), generator=g).tolist()


def _reference(model_dir: Path) -> list[int]:
    """transformers' greedy generate, one process, its default attention."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompt = _prompt(hf.config.vocab_size)
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long),
    )
    return out[0, PROMPT_LEN:].tolist()


def _ring(rank: int, world: int, model_dir: str, layouts: list[str]) -> dict[str, list[int]]:
    from workers.evals.generate import greedy_generate
    from workers.models import load_pretrained

    torch.set_num_threads(1)
    model = load_pretrained(model_dir)
    prompt = _prompt(model.config.vocab_size)
    return {layout: greedy_generate(model, prompt, NEW, layout=layout) for layout in layouts}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return write_checkpoint(
        tmp_path_factory.mktemp(family), family, max_position_embeddings=512, std=0.3
    )


def test_one_rank_equals_transformers_generate(checkpoint: Path) -> None:
    expected = _reference(checkpoint)
    got = _ring(0, 1, str(checkpoint), ["zigzag"])["zigzag"]
    assert len(set(expected)) > 2, expected  # a model that repeats one token proves little
    assert got == expected


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_ring_equals_transformers_generate(checkpoint: Path, world: int) -> None:
    expected = _reference(checkpoint)
    layouts = ["zigzag", "contiguous", "striped"]
    per_rank = run_distributed(_ring, world, str(checkpoint), layouts)
    for rank, got in enumerate(per_rank):
        for layout in layouts:
            assert got[layout] == expected, (rank, layout, got[layout], expected)


def test_generation_stops_after_the_first_stop_token(checkpoint: Path) -> None:
    """`stop`: the tokens up to and including the first one in `stop`, then nothing more (the
    reference is transformers' greedy output cut there by hand)."""
    from workers.evals.generate import greedy_generate
    from workers.models import load_pretrained

    expected = _reference(checkpoint)
    k = next(i for i in range(2, NEW - 1) if expected[i] not in expected[:i])
    model = load_pretrained(str(checkpoint))
    prompt = _prompt(model.config.vocab_size)
    got = greedy_generate(model, prompt, NEW, stop={expected[k]})
    assert got == expected[: k + 1]
    assert greedy_generate(model, prompt, 3) == expected[:3]


def test_evaluate_orders_lengths_and_scores_the_answer_without_the_stop_token(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`evaluate` with the generation stubbed (it is checked above): lengths run shortest first,
    the prompt is the tokenizer's encoding, and the prediction is the generated text without the
    end-of-sequence token it stopped on."""
    import workers.evals.run as run
    import workers.models
    from workers.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(checkpoint.resolve()))
    assert tok.eos_id is not None
    calls: list[tuple[int, int, set[int] | None]] = []

    def fake_generate(model: object, ids: list[int], max_new: int, **kw: object) -> list[int]:
        calls.append((len(ids), max_new, kw.get("stop")))  # type: ignore[arg-type]
        return [*tok.encode(" 1234567"), int(tok.eos_id)]  # type: ignore[arg-type]

    monkeypatch.setattr(run, "greedy_generate", fake_generate)
    monkeypatch.setattr(workers.models, "load_pretrained", lambda path: object())
    summary, records = run.evaluate(checkpoint, [700, 500], 1, tasks=["niah_single_noise"])
    assert [r["length"] for r in records] == [500, 700]
    for r, (n_ids, max_new, stop) in zip(records, calls, strict=True):
        assert r["prompt_tokens"] == n_ids == len(tok.encode(r["prompt"]))
        assert (max_new, stop) == (r["max_new_tokens"], {tok.eos_id})
        assert r["prediction"] == tok.decode(tok.encode(" 1234567"))
        assert r["score"] == (1.0 if r["answers"] == ["1234567"] else 0.0)
    assert sorted(summary["by_length"]) == ["500", "700"]
    with pytest.raises(ValueError, match="at least one length >= 1"):
        run.evaluate(checkpoint, [0, 500], 1)
