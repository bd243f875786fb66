"""`service.settings` as the README documents it, in process.

The defaults an operator reads in README.md (settings, database client, queue, rate limits, audit)
are the ones in effect; the PostgreSQL client settings render into exactly the libpq parameters and
`-c` startup options PostgreSQL expects (milliseconds for the timeouts); the token map refuses an
empty owner and a malformed hash and stores a hash in lower case (the form requests are compared
in); an empty token file reads as no token.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from service.settings import DatabaseClient, Settings, ensure_tokens, read_token_file

# README.md, "Settings", "Replicas", "Database client", "Priorities and quotas", "Sharing it safely"
DOCUMENTED = {
    "database_url": "sqlite:///./ringtrain.db",
    "host": "127.0.0.1",
    "port": 8000,
    "leader_lease_s": 15.0,
    "queue_reserve_after_s": 300.0,
    "queue_shrink_grace_s": 600.0,
    "rate_limits": True,
    "rate_api_per_s": 20.0,
    "rate_api_burst": 200,
    "rate_report_per_s": 50.0,
    "rate_report_burst": 300,
    "rate_unauth_per_s": 2.0,
    "rate_unauth_burst": 40,
    "audit_readers": ["admin"],
    "migrate_on_start": True,
    "tracking_retry_max_s": 60.0,  # README, "Results"
}
# Not in the docs: the shipped values, pinned so that a changed default is a visible decision.
SHIPPED = {
    "submit_attempts": 5,
    "cancel_grace_s": 60.0,
    "reconcile_grace_s": 15.0,
    "placement_timeout_s": 600.0,
    "max_body_bytes": 1024 * 1024,
    "max_report_bytes": 16 * 1024 * 1024,
    "sse_ping_s": 15.0,
}
DOCUMENTED_DB = {
    "pool_size": 10,
    "max_overflow": 20,
    "connect_timeout_s": 10,
    "keepalives_idle_s": 30,
    "keepalives_interval_s": 10,
    "keepalives_count": 3,
    "lock_timeout_s": 5.0,
    "idle_in_transaction_timeout_s": 10.0,
    "session_options": True,
}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("RINGTRAIN_"):
            monkeypatch.delenv(k)


@pytest.mark.usefixtures("clean_env")
def test_the_defaults_are_the_documented_ones() -> None:
    s = Settings()
    assert {k: getattr(s, k) for k in DOCUMENTED} == DOCUMENTED
    assert {k: getattr(s, k) for k in SHIPPED} == SHIPPED
    assert {k: getattr(s.db, k) for k in DOCUMENTED_DB} == DOCUMENTED_DB
    assert s.control_url == "http://127.0.0.1:8000"
    assert Settings(host="", port=8123).control_url == "http://127.0.0.1:8123"  # bind all: loopback


def test_client_settings_render_as_libpq_parameters_and_startup_options() -> None:
    """Every value distinct, so a swapped pair shows; timeouts in whole milliseconds."""
    c = DatabaseClient(
        connect_timeout_s=4,
        keepalives_idle_s=7,
        keepalives_interval_s=2,
        keepalives_count=5,
        lock_timeout_s=1.5,
        idle_in_transaction_timeout_s=3.25,
    )
    assert c.libpq_params() == {
        "connect_timeout": "4",
        "keepalives": "1",
        "keepalives_idle": "7",
        "keepalives_interval": "2",
        "keepalives_count": "5",
    }
    assert c.server_options() == (
        "-c lock_timeout=1500ms -c idle_in_transaction_session_timeout=3250ms "
        "-c tcp_keepalives_idle=7 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=5"
    )
    assert DatabaseClient(session_options=False).server_options() == ""


def test_token_map_refuses_empty_owners_and_bad_hashes_and_lowercases_hashes() -> None:
    token = "a-token-of-alice"
    digest = hashlib.sha256(token.encode()).hexdigest()
    assert digest != digest.upper()
    s = Settings(api_tokens={f"sha256:{digest.upper()}": "alice", "plain-token-1": "bob"})
    assert s.api_tokens == {f"sha256:{digest}": "alice", "plain-token-1": "bob"}
    with pytest.raises(ValueError, match="non-empty owner"):
        Settings(api_tokens={"plain-token-1": ""})
    for bad in (digest[:63], digest + "0", "g" * 64):
        with pytest.raises(ValueError, match="64 hex digits"):
            Settings(api_tokens={f"sha256:{bad}": "alice"})


def test_an_empty_token_file_is_no_token_and_a_generated_one_is_private(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert read_token_file(empty) is None
    assert read_token_file(tmp_path / "missing") is None
    path = tmp_path / "token"
    path.write_text("")
    path.chmod(0o644)  # left behind empty and readable: regenerated, and made private
    (token,) = ensure_tokens(Settings(token_file=path), announce=False)
    assert len(token) >= 32 and read_token_file(path) == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # an empty map (RINGTRAIN_API_TOKENS='{}') is no map: the admin token, not a locked-out API
    assert ensure_tokens(Settings(token_file=path, api_tokens={}), announce=False) == {
        token: "admin"
    }
