"""Control-plane settings as an operator writes them (`service.settings`): `RINGTRAIN_*` variables holding JSON,
the URL drivers report to, and the generated admin token file."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from service.admission import NodeShape, Quota
from service.settings import Settings, ensure_tokens, read_token_file


@pytest.mark.parametrize(
    ("env", "url"),
    [
        ({"RINGTRAIN_HOST": "0.0.0.0", "RINGTRAIN_PORT": "8080"}, "http://127.0.0.1:8080"),
        ({"RINGTRAIN_HOST": "::", "RINGTRAIN_PORT": "9000"}, "http://127.0.0.1:9000"),
        ({"RINGTRAIN_HOST": "10.1.2.3"}, "http://10.1.2.3:8000"),
        ({"RINGTRAIN_PUBLIC_URL": "http://ringtrain-api:8000//"}, "http://ringtrain-api:8000"),
    ],
)
def test_the_url_drivers_report_to(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], url: str
) -> None:
    """A wildcard bind address is no address to dial: drivers get loopback; a public URL is used as given,
    without the trailing slash (the report path is appended to it)."""
    for k in ("RINGTRAIN_HOST", "RINGTRAIN_PORT", "RINGTRAIN_PUBLIC_URL"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert Settings().control_url == url


def test_json_variables_parse_into_their_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quotas, autoscaler node shapes, data roots and driver resources come as JSON in one variable each."""
    quotas = {"alice": {"max_running_jobs": 2, "max_gpus": 8}, "bob": {"max_cpus": 16.5}}
    monkeypatch.setenv("RINGTRAIN_QUOTAS", json.dumps(quotas))
    monkeypatch.setenv(
        "RINGTRAIN_AUTOSCALER_NODES", '[{"cpus": 32, "gpus": 4, "max_nodes": 3, "group": "gpu"}]'
    )
    monkeypatch.setenv("RINGTRAIN_DATA_ROOTS", '["/data", "/scratch"]')
    monkeypatch.setenv("RINGTRAIN_DRIVER_RESOURCES", '{"ringtrain_driver": 1}')
    s = Settings()
    assert s.quotas == {
        "alice": Quota(max_running_jobs=2, max_cpus=None, max_gpus=8.0),
        "bob": Quota(max_running_jobs=None, max_cpus=16.5, max_gpus=None),
    }
    assert s.autoscaler_nodes == [NodeShape(cpus=32, gpus=4, max_nodes=3, group="gpu")]
    assert s.resolved_data_roots() == [Path("/data"), Path("/scratch")]
    assert s.driver_resources == {"ringtrain_driver": 1.0}
    monkeypatch.setenv("RINGTRAIN_QUOTAS", '{"alice": {"max_jobs": 2}}')  # a misspelt limit
    with pytest.raises(ValueError, match="max_jobs"):
        Settings()


def test_tokens_variable_blank_means_generate_and_short_tokens_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A blank RINGTRAIN_API_TOKENS (a Helm value left empty) is unset: the admin token is generated."""
    monkeypatch.setenv("RINGTRAIN_API_TOKENS", "  ")
    tokens = ensure_tokens(Settings(token_file=tmp_path / "token"), announce=False)
    assert list(tokens.values()) == ["admin"]
    assert list(tokens) == [read_token_file(tmp_path / "token")]
    monkeypatch.setenv("RINGTRAIN_API_TOKENS", '{"12345678": "alice"}')  # 8 characters: the minimum
    assert Settings().api_tokens == {"12345678": "alice"}
    monkeypatch.setenv("RINGTRAIN_API_TOKENS", '{"1234567": "alice"}')
    with pytest.raises(ValueError, match=">= 8 characters"):
        Settings()


def test_the_admin_token_is_generated_once_kept_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "home" / "token"
    first = ensure_tokens(Settings(token_file=path), announce=False)
    ((token, owner),) = first.items()
    assert owner == "admin" and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token_file(path) == token
    assert ensure_tokens(Settings(token_file=path), announce=False) == {token: "admin"}
    given = {"a-token-of-alice": "alice"}
    assert ensure_tokens(Settings(token_file=tmp_path / "unused", api_tokens=given)) == given
    assert not (tmp_path / "unused").exists()
