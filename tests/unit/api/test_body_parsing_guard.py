"""Request-body parsing and the data-root check, called in process: a body that is not JSON is a 400
(not a 422), a spec sent without a content type is read as JSON, and a path that only looks inside
a data root (a symlink out of it) is refused under its field name, and a tokens dataset's
`data.path` is held to the roots as a text file's is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from api.body import check_data_path, check_path_in_roots, parse_json_body, parse_spec
from api.errors import ApiError
from tests.support.api_harness import TINY_SPEC
from workers.config import JobSpec


class _Req(BaseModel):
    n: int


def test_a_body_that_is_not_json_is_400_and_a_bad_field_422() -> None:
    with pytest.raises(ApiError) as e:
        parse_json_body(b"{oops", _Req, "thing request")
    assert (e.value.status, e.value.code) == (400, "malformed_json")
    with pytest.raises(ApiError) as e:
        parse_json_body(b'{"n": "x"}', _Req, "thing request")
    assert (e.value.status, e.value.field) == (422, "n")
    assert parse_json_body(b'{"n": 3}', _Req, "thing request").n == 3


@pytest.mark.parametrize("ctype", [None, ""])
def test_a_spec_without_a_content_type_is_json(ctype: str | None) -> None:
    spec = parse_spec(json.dumps({**TINY_SPEC, "name": "untyped"}).encode(), ctype)
    assert spec.name == "untyped" and spec.train.steps == 5


def test_a_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(ApiError) as e:
        check_path_in_roots(str(root / "link"), [root.resolve()], "data.path")
    assert (e.value.status, e.value.field) == (422, "data.path")
    inside = root / "corpus.txt"
    assert check_path_in_roots(str(inside), [root.resolve()], "data.path") == inside.resolve()


@pytest.mark.parametrize("kind", ["text", "tokens"])
def test_a_data_path_outside_the_roots_is_refused_for_both_kinds(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "elsewhere" / "corpus"
    spec = JobSpec.model_validate(
        {**TINY_SPEC, "data": {"kind": kind, "path": str(outside), "seq_len": 128}}
    )
    with pytest.raises(ApiError) as e:
        check_data_path(spec, [root.resolve()])
    assert (e.value.status, e.value.field) == (422, "data.path")
    inside = JobSpec.model_validate(
        {**TINY_SPEC, "data": {"kind": kind, "path": str(root / "corpus"), "seq_len": 128}}
    )
    check_data_path(inside, [root.resolve()])
