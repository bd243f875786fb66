"""The error shape's pieces (api/errors.py) with known answers: the dotted field path of a
pydantic location (no `body.` prefix, no union tag under `data`), where a query or path problem
came from, the summary message with the count of further problems, and the code of each status."""

from __future__ import annotations

from api.errors import ApiError, field_path, status_code_name, validation_error


def test_field_paths() -> None:
    assert field_path(("body", "data", "seq_len")) == "data.seq_len"
    assert field_path(("body", "data", "passkey", "seq_len")) == "data.seq_len"  # union tag
    assert field_path(("body", "model", "passkey")) == "model.passkey"  # a tag only under data
    assert field_path(("query", "limit")) == "limit"
    assert field_path(("state", 0)) == "state.0"
    assert field_path(()) == ""


def test_validation_error_summarises_and_details_every_problem() -> None:
    errs = [
        {"loc": ("body", "train", "steps"), "msg": "must be > 0", "type": "greater_than"},
        {"loc": ("query", "limit"), "msg": "too big", "type": "less_than_equal"},
        {"loc": ("path", "job_id"), "msg": "bad id", "type": "string_pattern_mismatch"},
    ]
    e = validation_error(errs, "job spec")
    assert (e.status, e.code, e.field) == (422, "validation_error", "train.steps")
    assert (
        e.message
        == "invalid job spec: train.steps: must be > 0 (and 2 more problem(s), see details)"
    )
    assert [d.get("in") for d in e.details] == [None, "query", "path"]
    one = validation_error([{"loc": (), "msg": "invalid", "type": "x"}])
    assert one.message == "invalid request: invalid" and one.field is None


def test_codes_by_status() -> None:
    assert [status_code_name(s) for s in (401, 403, 409, 413, 415, 429, 503, 418)] == [
        "unauthorized",
        "forbidden",
        "conflict",
        "payload_too_large",
        "unsupported_media_type",
        "too_many_requests",
        "unavailable",
        "error",
    ]
    assert ApiError(404, "x").code == "not_found" and ApiError(404, "x", code="gone").code == "gone"
