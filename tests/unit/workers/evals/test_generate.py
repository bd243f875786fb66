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
