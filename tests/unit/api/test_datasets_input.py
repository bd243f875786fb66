"""POST /v1/datasets refuses what can only fail later, naming the field, and stores nothing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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


def test_cli_prepare_refuses_an_out_outside_the_servers_data_roots(
    tmp_path: Path, capsys: Any
) -> None:
    """With a server configured, `ringtrain data prepare --out` outside its data roots stops before
    any work (exit 2, saying where to prepare instead): a job reading it there would be refused.
    Inside a root, or with no server to ask, nothing is said."""
    from api.cli import main
    from api.cli.data import outside_server_roots
    from tests.support.api_harness import ALICE

    roots = tmp_path / "data"
    roots.mkdir()
    src = tmp_path / "corpus.txt"
    src.write_text("a document")
    outside = tmp_path / "elsewhere" / "ds"
    with running(tmp_path, data_roots=[str(roots)]) as srv:
        with srv.client() as c:
            assert c.get("/v1/datasets/roots").json() == {"data_roots": [str(roots.resolve())]}
        base = ["data", "prepare", str(src), "--tokenizer", "bytes", "--url", srv.url]
        code = main([*base, "--token", ALICE, "--out", str(outside)])
        said = " ".join(capsys.readouterr().out.split())
        assert code == 2, said
        assert f"--out {outside} is outside the data roots" in said and str(roots) in said, said
        assert not outside.exists() and not outside.parent.exists()  # nothing was prepared

        args = argparse.Namespace(url=srv.url, token=ALICE, out=str(roots / "ds"))
        assert outside_server_roots(args) is None  # inside a root
        args.out = str(outside)
        assert "outside the data roots" in (outside_server_roots(args) or "")
    # the server is gone: no server to ask, nothing to say (a prepare needs no server)
    assert outside_server_roots(args) is None


def test_dataset_and_eval_bodies_share_one_reader(tmp_path: Path) -> None:
    """POST /v1/datasets and /v1/evals read their bodies alike: not JSON (or nested past the
    parser's depth) is a 400 `malformed_json`, a body that does not validate a 422 naming the
    field; nothing is stored either way."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with running(tmp_path, data_roots=[str(tmp_path)]) as srv, srv.client() as c:
        for path, bad_field in (("/v1/datasets", "source"), ("/v1/evals", "samples")):
            for raw in (b"{not json", deep):
                r = c.post(path, content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["code"] == "malformed_json", (path, r.text)
            body = {"source": 7} if path == "/v1/datasets" else {"model": str(tmp_path)}
            if path == "/v1/evals":
                body |= {"suite": "ruler", "lengths": [4096], "samples": 0}
            r = c.post(path, json=body)
            assert r.status_code == 422 and r.json()["error"]["field"] == bad_field, (path, r.text)
            assert c.get(path).json() == []
