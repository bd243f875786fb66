"""Passkey task and eval: the curriculum, the model's tokenizer, and the grid scored against oracles."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import nn

from tests.support.dist import run_distributed
from tests.support.trainutil import one_thread, series, source_of, tiny_spec, train
from workers.attention import unshard_sequence
from workers.data import ByteTokenizer, PasskeySource, make_sample, sample_generator
from workers.data.tokenizer import HFTokenizer, Tokenizer
from workers.parallel_dims import ParallelDims
from workers.training import evals
from workers.training.evals import EVAL_SALT, cell_name, passkey_accuracy
from workers.training.mesh import Mesh, build_mesh

assert one_thread  # autouse fixture, imported to apply to this module

KEY_RE = re.compile(r"pass key (?:is )?(\d+)\.")


class Oracle(nn.Module):
    """Reads the needle and predicts every next token (gathering the ring's shards first).

    `wrong_last`: the last answer token is replaced (by the next id) when the key's first digit is odd,
    so exactly one answer token of those samples is wrong.
    """

    def __init__(
        self, tok: Tokenizer, group: dist.ProcessGroup | None, layout: str, wrong_last: bool
    ) -> None:
        super().__init__()
        self.tok, self.group, self.layout, self.wrong_last = tok, group, layout, wrong_last
        self.vocab = max(256, tok.vocab_size + 1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        full = (
            tokens if self.group is None else unshard_sequence(tokens, 1, self.layout, self.group)
        )
        out = torch.zeros(*tokens.shape, self.vocab)
        for row in range(full.shape[0]):
            key = KEY_RE.search(self.tok.decode(full[row])).group(1)
            last = self.tok.encode(key)[-1]
            if self.wrong_last and int(key[0]) % 2:
                last += 1
            targets = torch.cat([full[row, 1:], torch.tensor([last])])
            out[row, torch.arange(tokens.shape[1]), targets[positions]] = 1.0
        return out


def _expected(spec, tok: Tokenizer) -> tuple[dict[str, float], dict[str, float]]:
    """Independent count: exact match fails iff the key's first digit is odd; then one answer token is wrong."""
    exact, per_token = {}, {}
    for length in spec.eval_context_lengths():
        for depth in spec.eval.depths:
            keys = [
                make_sample(
                    length,
                    spec.data.key_digits,
                    depth,
                    sample_generator(spec.train.seed ^ EVAL_SALT, length, round(depth * 1e4), i),
                    tokenizer=tok,
                ).key
                for i in range(spec.eval.samples)
            ]
            odd = [int(k[0]) % 2 == 1 for k in keys]
            exact[cell_name(length, depth)] = sum(not o for o in odd) / len(keys)
            per_token[cell_name(length, depth, "passkey_token_acc")] = sum(
                1 - o / len(tok.encode(k)) for k, o in zip(keys, odd, strict=True)
            ) / len(keys)
    return exact, per_token


def _check(results: dict[bool, dict[str, float]], spec, tok: Tokenizer) -> None:
    exact, per_token = _expected(spec, tok)
    assert (
        0 < sum(exact.values()) / len(exact) < 1
    )  # the wrong oracle is neither all right nor all wrong
    assert results[False] == {
        "passkey_acc": 1.0,
        **dict.fromkeys(exact, 1.0),
        "passkey_token_acc": 1.0,
        **dict.fromkeys(per_token, 1.0),
    }
    wrong = results[True]
    assert wrong.keys() == results[False].keys()
    for name, value in {**exact, **per_token}.items():
        assert wrong[name] == pytest.approx(value), name
    assert wrong["passkey_acc"] == pytest.approx(sum(exact.values()) / len(exact))
    assert wrong["passkey_token_acc"] == pytest.approx(sum(per_token.values()) / len(per_token))
    assert (
        wrong["passkey_token_acc"] > wrong["passkey_acc"]
    )  # one wrong digit still scores the others


EVAL = {"enabled": True, "context_lengths": [96, 192], "depths": [0.0, 0.5, 1.0], "samples": 7}


def _ring_eval(rank: int, world: int, layout: str) -> dict[bool, dict[str, float]]:
    spec = tiny_spec(
        parallel={"ring_size": world, "layout": layout}, data={"key_digits": 4}, eval=EVAL
    )
    mesh = build_mesh(ParallelDims(ring_size=world))
    return {
        w: passkey_accuracy(
            Oracle(ByteTokenizer(), mesh.ring_group, layout, w), spec, mesh, torch.device("cpu")
        )
        for w in (False, True)
    }


@pytest.mark.multiprocess
def test_eval_grid_on_an_odd_ring_scores_oracles_exactly():
    out = run_distributed(_ring_eval, 3, "striped")
    spec = tiny_spec(data={"key_digits": 4}, eval=EVAL)
    for rank_results in out:  # every rank reports the same numbers
        _check(rank_results, spec, ByteTokenizer())


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny BPE tokenizer trained on the passkey phrasing: digits and words merge into multi-byte tokens."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from workers.data.passkey import FILLER, INTRO, NEEDLE, QUESTION

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = [INTRO, FILLER * 3, QUESTION] + [NEEDLE.format(key=k) for k in range(0, 100000, 37)]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(corpus, trainer)
    out = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(out)
    return str(out)


def test_prompts_and_answers_are_in_the_models_tokens(bpe_dir, monkeypatch):
    tok = HFTokenizer(bpe_dir)
    lengths = []
    for i in range(20):
        s = make_sample(96, 5, 0.5, sample_generator(1, i), answer_weight=3.0, tokenizer=tok)
        answer = s.tokens[1:][s.answer_start :]
        assert (
            len(s.tokens) == 97
            and tok.decode(answer) == s.key
            and answer.tolist() == tok.encode(s.key)
        )
        assert KEY_RE.search(tok.decode(s.tokens)).group(1) == s.key
        assert torch.equal(s.weights == 3.0, s.answer_mask() == 1.0)
        lengths.append(len(answer))
    assert max(lengths) < 5  # the BPE merged digits: scored in model tokens, not bytes

    # the eval asks and scores in the same tokens (single process)
    monkeypatch.setattr(evals, "tokenizer_for", lambda spec: tok)
    spec = tiny_spec(data={"key_digits": 5}, eval=EVAL)
    mesh = Mesh()
    results = {
        w: passkey_accuracy(Oracle(tok, None, "zigzag", w), spec, mesh, torch.device("cpu"))
        for w in (False, True)
    }
    _check(results, spec, tok)


def test_curriculum_trains_short_contexts_first_and_is_layout_independent():
    stages = [{"steps": 3, "seq_len": 96}, {"steps": 2, "seq_len": 192}]
    spec = tiny_spec(data={"seq_len": 384, "curriculum": stages})
    src = source_of(spec)
    assert isinstance(src, PasskeySource)
    assert [src.length_at(s) for s in range(7)] == [96, 96, 96, 192, 192, 384, 384]
    for step, length in [(0, 96), (4, 192), (5, 384)]:
        b = src.global_batch(step, 2)
        assert b.inputs.shape == (2, length) and b.positions.tolist() == list(range(length))
        assert torch.equal(b.inputs[:, 1:], b.labels[:, :-1])
        assert ByteTokenizer().decode(b.labels[0, -spec.data.key_digits :]).isdigit()
    # the batch of a step is the same whatever the ring (as long as every stage length is valid for it)
    ring = tiny_spec(
        data={"seq_len": 384, "curriculum": stages}, parallel={"ring_size": 3, "layout": "striped"}
    )
    for step in (1, 3, 6):
        assert torch.equal(
            source_of(ring).global_batch(step, 2).inputs, src.global_batch(step, 2).inputs
        )
    # without a curriculum: unchanged stream
    plain = source_of(tiny_spec(data={"seq_len": 384}))
    assert torch.equal(plain.global_batch(6, 2).inputs, src.global_batch(6, 2).inputs)


@pytest.mark.parametrize(
    ("curriculum", "parallel", "loc"),
    [
        (
            [{"steps": 3, "seq_len": 768}],
            {},
            ("data", "curriculum", 0, "seq_len"),
        ),  # longer than data.seq_len
        (
            [{"steps": 3, "seq_len": 96}, {"steps": 1, "seq_len": 99}],
            {},
            ("data", "curriculum", 1, "seq_len"),
        ),  # odd
        (
            [{"steps": 3, "seq_len": 96}],
            {"ring_size": 5},
            ("data", "curriculum", 0, "seq_len"),
        ),  # 96 % 10
        ([{"steps": 0, "seq_len": 96}], {}, ("data", "curriculum", 0, "steps")),
        ([{"steps": 1, "seq_len": 32}], {}, ("data", "curriculum", 0, "seq_len")),
    ],
)
def test_bad_curriculum_names_the_field(curriculum, parallel, loc):
    with pytest.raises(ValidationError) as exc:
        tiny_spec(data={"seq_len": 480, "curriculum": curriculum}, parallel=parallel)
    # pydantic puts the union's tag ("passkey") into field locations; the API drops it (api/errors.py)
    assert [tuple(p for p in e["loc"] if p != "passkey") for e in exc.value.errors()] == [loc]


CURRICULUM = {"seq_len": 192, "curriculum": [{"steps": 2, "seq_len": 96}]}


def _train_curriculum(rank: int, world: int, spec_json: str) -> dict:
    return train(rank, world, spec_json, None, None)


@pytest.mark.multiprocess
def test_curriculum_trains_identically_on_an_odd_ring():
    """Steps 1-2 on 96 tokens, 3-4 on 192, evals at both: a ring of 3 (striped) reproduces one process."""
    over = {
        "data": CURRICULUM,
        "train": {"steps": 4},
        "eval": {**EVAL, "every_steps": 2, "samples": 2},
    }
    one = _train_curriculum(0, 1, tiny_spec(**over).model_dump_json())["points"]
    ring = tiny_spec(**over, parallel={"ring_size": 3, "layout": "striped"}).model_dump_json()
    three = run_distributed(_train_curriculum, 3, ring)[0]["points"]
    names = {p["name"] for p in one if p["name"].startswith("passkey_")}
    assert len(names) == 2 + 2 * 6  # two means, 2 lengths × 3 depths × (exact, per token)
    for name in ["loss", *sorted(names)]:
        a, b = series(one, name), series(three, name)
        assert len(a) == (4 if name == "loss" else 2) and a == pytest.approx(
            b, rel=1e-5, abs=1e-6
        ), name
    assert series(one, "loss")[0] > series(one, "loss")[-1]
