"""POST /v1/datasets refuses what can only fail later, naming the field, and stores nothing."""

from __future__ import annotations

from pathlib import Path

from tests.support.api_harness import running


def test_chat_with_the_bytes_tokenizer_is_a_422_naming_format(tmp_path: Path) -> None:
    src = tmp_path / "chats.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    body = {"source": str(src), "out": str(tmp_path / "out"), "format": "chat"}
    with running(tmp_path) as srv, srv.client() as c:
        r = c.post("/v1/datasets", json={**body, "tokenizer": "bytes"})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["field"] == "format" and "chat template" in err["message"], err
        assert c.get("/v1/datasets").json() == []  # nothing half-made
        # the same request as text is fine: the refusal is about the pair, not either field
        ok = c.post("/v1/datasets", json={**body, "format": "text", "tokenizer": "bytes"})
        assert ok.status_code == 201, ok.text
