"""Prepared datasets made in this process (`prepare(..., inline=True)`, the code each Ray task runs).

Without a Ray cluster these run in the fast tier. Expected values never come from the code under
test: token ids are the tokenizer's own encoding (`tokenizer.encode` of each piece of text), and the
assistant mask is written by hand from the template's structure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.unit.workers.data.test_prepare import write_tokenizer
from workers.data import open_dataset
from workers.data.prepare import prepare

EOS = "<|endoftext|>"

# No {% generation %}: prepare's "prefixes" rule computes the mask. Every turn renders as
# "role:\n" + content + eos + "\n"; the trailing "\n" is the template's formatting, not the answer.
PREFIX_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ':' }}{{ '\\n' }}{{ m['content'] }}"
    + EOS
    + "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{{ '\\n' }}{% endif %}"
)

CHATS: list[list[dict[str, str]]] = [
    [
        {"role": "user", "content": "What is the pass key?"},
        {"role": "assistant", "content": "The pass key is 48213."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sky?"},
        {"role": "assistant", "content": "The sky is blue."},
        {"role": "user", "content": "Grass?"},
        {"role": "assistant", "content": "The grass is green."},
        {"role": "user", "content": "Thanks."},
    ],
]


def load(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def expected_chat(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """Ids and assistant mask built piece by piece from PREFIX_TEMPLATE's structure: the role line
    is never learned, an assistant's content and its eos are, the newline after them is not."""
    ids: list[int] = []
    mask: list[bool] = []
    newline = tok.encode("\n", add_special_tokens=False)
    for m in messages:
        learned = m["role"] == "assistant"
        head = tok.encode(m["role"] + ":\n", add_special_tokens=False)
        body = [*tok.encode(m["content"], add_special_tokens=False), tok.eos_token_id]
        ids += head + body + newline
        mask += [False] * len(head) + [learned] * len(body) + [False] * len(newline)
    return ids, mask


def test_prefixes_rule_masks_assistant_content_without_the_templates_newline(
    tmp_path: Path,
) -> None:
    """The "prefixes" rule (no {% generation %} in the template) drops the trailing whitespace
    that closes an assistant turn: the newline after eos is formatting, not something to learn."""
    tok_dir = write_tokenizer(tmp_path / "tok", PREFIX_TEMPLATE)
    tok = load(tok_dir)
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1  # one token of its own: the mask can exclude it exactly
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    out = tmp_path / "ds"
    manifest = prepare(src, out, tokenizer=str(tok_dir), fmt="chat", inline=True)
    assert manifest["tokenizer"]["mask_rule"] == "prefixes"
    ds = open_dataset(out)
    assert len(ds) == len(CHATS)
    for i, messages in enumerate(CHATS):
        want_ids, want_mask = expected_chat(tok, messages)
        np.testing.assert_array_equal(ds[i]["tokens"], want_ids)
        np.testing.assert_array_equal(ds[i]["loss_mask"], np.asarray(want_mask, dtype=bool))
        # the token right after each learned eos is the template's newline, and it is not learned
        got, mask = ds[i]["tokens"], ds[i]["loss_mask"]
        after_eos = [j + 1 for j in range(len(got) - 1) if got[j] == tok.eos_token_id and mask[j]]
        assert after_eos and all(got[j] == newline[0] and not mask[j] for j in after_eos)


def test_documents_across_shards_read_back_as_the_tokenizers_encoding(tmp_path: Path) -> None:
    """Small chunks make one jsonl several shards; documents in later shards read back (by index
    and by their span of the whole token stream) as the tokenizer's own encoding plus eos."""
    tok_dir = write_tokenizer(tmp_path / "tok", None)
    tok = load(tok_dir)
    words = ["The sky is blue.", "The grass is green.", "Here we go.", "The sun is yellow."]
    texts = [" ".join(words[(i + j) % 4] for j in range(1 + i % 5)) + f" {i}" for i in range(16)]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "ds"
    manifest = prepare(src, out, tokenizer=str(tok_dir), inline=True, chunk_bytes=160)
    shards = manifest["files"][0]["shards"]
    assert len(shards) >= 3 and all(s["documents"] > 0 for s in shards)

    # encode_text's rule: the tokenizer's own encoding, then eos
    want = [[*tok.encode(t), tok.eos_token_id] for t in texts]
    starts = np.concatenate([[0], np.cumsum([len(w) for w in want])]).tolist()
    ds = open_dataset(out)
    assert len(ds) == len(texts) and ds.num_tokens == starts[-1]
    first = shards[0]["documents"]
    later = range(first, first + shards[1]["documents"] + shards[2]["documents"])
    assert len(later) >= 2  # the 2nd and 3rd shards' documents
    for i in later:
        np.testing.assert_array_equal(ds[i]["tokens"], want[i])
        assert ds.doc_span(i) == (starts[i], starts[i + 1]), i
        tokens, mask = ds.read(*ds.doc_span(i))
        np.testing.assert_array_equal(tokens, want[i])
        assert mask.all()
