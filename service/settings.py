"""All control-plane settings in one typed object (`RINGTRAIN_*` environment variables or `serve` flags)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.admission import Quota

DEFAULT_TOKEN_FILE = Path("~/.ringtrain/token")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RINGTRAIN_", extra="ignore")

    database_url: str = "sqlite:///./ringtrain.db"
    ray_address: str = Field("", description="Ray dashboard/job API, e.g. http://head:8265; empty = local head")
    api_tokens: dict[str, str] | None = Field(None, description="JSON object token → owner")
    token_file: Path = Field(DEFAULT_TOKEN_FILE, description="where the generated admin token is kept")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    checkpoint_dir: str = "./checkpoints"
    public_url: str = Field("", description="URL drivers POST reports to; default http://host:port")
    placement_timeout_s: float = Field(600.0, gt=0)
    data_roots: list[str] = Field(default_factory=lambda: ["."], description="allowed roots for data.path")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body on user routes")
    max_report_bytes: int = Field(16 << 20, ge=1024, description="largest report batch from a driver")
    scheduler_interval_s: float = Field(0.5, gt=0)
    reconcile_interval_s: float = Field(5.0, gt=0)
    reconcile_grace_s: float = Field(15.0, ge=0, description="wait this long for a final report after Ray ends")
    cancel_grace_s: float = Field(60.0, ge=0, description="force CANCELLED if the driver has not confirmed by then")
    submit_attempts: int = Field(5, ge=1, description="Ray submission tries before a job fails")
    sse_ping_s: float = Field(15.0, gt=0)
    quotas: dict[str, Quota] = Field(
        default_factory=dict, description="JSON owner → {max_running_jobs, max_cpus, max_gpus} (admission queue)"
    )
    queue_reserve_after_s: float = Field(
        300.0, ge=0, description="a queued job that waited this long keeps later jobs from starting past it"
    )
    queue_shrink_grace_s: float = Field(
        600.0, ge=0, description="a queued job larger than the cluster (nodes lost) fails after waiting this long"
    )
    log_level: str = "INFO"

    @field_validator("api_tokens", mode="before")
    @classmethod
    def _tokens(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            if not v:
                return None
            v = json.loads(v)
        if isinstance(v, dict):
            for token, owner in v.items():
                if not isinstance(token, str) or len(token) < 8 or not isinstance(owner, str) or not owner:
                    raise ValueError("api_tokens must map tokens (≥ 8 characters) to non-empty owner names")
        return v

    @property
    def control_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def resolved_data_roots(self) -> list[Path]:
        return [Path(r).expanduser().resolve() for r in self.data_roots]


def ensure_tokens(settings: Settings, *, announce: bool = True) -> dict[str, str]:
    """The token → owner map. Unset: reuse or generate one admin token kept in `token_file` (mode 0600).

    The token is printed once, when generated; never logged.
    """
    if settings.api_tokens:
        return dict(settings.api_tokens)
    path = settings.token_file.expanduser()
    token = ""
    if path.is_file():
        token = path.read_text().strip()
    if not token:
        token = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.chmod(path, 0o600)
        if announce:
            print(f"ringtrain: generated admin API token (saved to {path}, mode 0600):\n  {token}", flush=True)
    elif announce:
        print(f"ringtrain: using the admin API token saved in {path}", flush=True)
    settings.api_tokens = {token: "admin"}
    return dict(settings.api_tokens)


def read_token_file(path: Path = DEFAULT_TOKEN_FILE) -> str | None:
    p = path.expanduser()
    try:
        return p.read_text().strip() or None
    except OSError:
        return None
