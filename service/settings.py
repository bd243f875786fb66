"""All control-plane settings in one typed object (`RINGTRAIN_*` environment variables or `serve`
flags)."""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.admission import NodeShape, Quota

DEFAULT_TOKEN_FILE = Path("~/.ringtrain/token")
HASHED_PREFIX = (
    "sha256:"  # an api_tokens key with this prefix is the hex SHA-256 of the token, not the token
)


class DatabaseClient(BaseSettings):
    """How the control plane holds its PostgreSQL connections (`RINGTRAIN_DB_*`; SQLite ignores
    them). The defaults suit a direct connection to PostgreSQL; `service.db.make_engine` applies
    them to the pool and `service.db.listen_dsn` to the LISTEN connection.

    Connections per replica: at most `pool_size + max_overflow` from the pool plus two of the
    event relay (LISTEN and NOTIFY); with the defaults, 2 replicas hold up to 2 x (10 + 20 + 2)
    = 64, and a one-off `ringtrain db upgrade` one more. Small managed tiers (often 25 to 100
    connections) want e.g. pool_size 5 and max_overflow 5.
    """

    model_config = SettingsConfigDict(env_prefix="RINGTRAIN_DB_", extra="ignore")

    pool_size: int = Field(10, ge=1, description="connections the pool keeps open")
    max_overflow: int = Field(
        20, ge=0, description="connections opened beyond pool_size under load, closed after"
    )
    connect_timeout_s: int = Field(
        10, ge=2, description="give up a connection attempt after this long (libpq: >= 2 s)"
    )
    keepalives_idle_s: int = Field(
        30, ge=1, description="TCP keepalives, both ends: first probe after this much silence"
    )
    keepalives_interval_s: int = Field(10, ge=1, description="then one probe per interval")
    keepalives_count: int = Field(
        3, ge=1, description="a peer silent for this many probes is dead (30 + 3 x 10 = 60 s)"
    )
    lock_timeout_s: float = Field(
        5.0, gt=0, description="a statement waiting longer for a row or table lock fails"
    )
    idle_in_transaction_timeout_s: float = Field(
        10.0,
        gt=0,
        description="PostgreSQL ends a session idle this long inside a transaction (a client "
        "that died mid-write) and frees its locks; keep it below the leader lease",
    )
    session_options: bool = Field(
        True,
        description="send lock_timeout, idle_in_transaction_session_timeout and the server's "
        "keepalives as startup options; false behind PgBouncer, which refuses them (set them "
        "on the role instead: ALTER ROLE ... SET lock_timeout = '5s', ...)",
    )

    def libpq_params(self) -> dict[str, str]:
        """Connection parameters libpq reads from a URL or a conninfo string."""
        return {
            "connect_timeout": str(self.connect_timeout_s),
            "keepalives": "1",
            "keepalives_idle": str(self.keepalives_idle_s),
            "keepalives_interval": str(self.keepalives_interval_s),
            "keepalives_count": str(self.keepalives_count),
        }

    def server_options(self) -> str:
        """The `options` startup parameter: the session settings PostgreSQL applies from the
        first statement on (empty when `session_options` is off)."""
        if not self.session_options:
            return ""
        settings = {
            "lock_timeout": f"{round(self.lock_timeout_s * 1000)}ms",
            "idle_in_transaction_session_timeout": (
                f"{round(self.idle_in_transaction_timeout_s * 1000)}ms"
            ),
            "tcp_keepalives_idle": str(self.keepalives_idle_s),
            "tcp_keepalives_interval": str(self.keepalives_interval_s),
            "tcp_keepalives_count": str(self.keepalives_count),
        }
        return " ".join(f"-c {k}={v}" for k, v in settings.items())


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RINGTRAIN_", extra="ignore")

    database_url: str = "sqlite:///./ringtrain.db"
    db: DatabaseClient = Field(
        default_factory=DatabaseClient,
        description="PostgreSQL client settings, from RINGTRAIN_DB_* (see DatabaseClient)",
    )
    ray_address: str = Field(
        "", description="Ray dashboard/job API, e.g. http://head:8265; empty = local head"
    )
    api_tokens: dict[str, str] | None = Field(
        None,
        description="JSON object token -> owner; a key 'sha256:<64 hex>' is the SHA-256 of a "
        "token, not a token",
    )
    token_file: Path = Field(
        DEFAULT_TOKEN_FILE, description="where the generated admin token is kept"
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    checkpoint_dir: str = "./checkpoints"
    public_url: str = Field("", description="URL drivers POST reports to; default http://host:port")
    placement_timeout_s: float = Field(600.0, gt=0)
    data_roots: list[str] = Field(
        default_factory=lambda: ["."], description="allowed roots for data.path"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body on user routes")
    max_report_bytes: int = Field(
        16 << 20, ge=1024, description="largest report batch from a driver"
    )
    scheduler_interval_s: float = Field(0.5, gt=0)
    reconcile_interval_s: float = Field(5.0, gt=0)
    reconcile_grace_s: float = Field(
        15.0, ge=0, description="wait this long for a final report after Ray ends"
    )
    cancel_grace_s: float = Field(
        60.0, ge=0, description="force CANCELLED if the driver has not confirmed by then"
    )
    submit_attempts: int = Field(5, ge=1, description="Ray submission tries before a job fails")
    ray_check_interval_s: float = Field(
        5.0, gt=0, description="how often the background check reads the Ray cluster (/healthz)"
    )
    ray_check_timeout_s: float = Field(
        5.0, gt=0, description="a Ray check without an answer this long reports Ray unreachable"
    )
    sse_ping_s: float = Field(15.0, gt=0)
    quotas: dict[str, Quota] = Field(
        default_factory=dict,
        description="JSON owner -> {max_running_jobs, max_cpus, max_gpus} (admission queue)",
    )
    queue_reserve_after_s: float = Field(
        300.0,
        ge=0,
        description="a queued job that waited this long keeps later jobs from starting past it",
    )
    autoscaler_nodes: list[NodeShape] = Field(
        default_factory=list,
        description="JSON list of {cpus, gpus, max_nodes, group}: per worker group, "
        "the pod resources and maxReplicas "
        "(nodes the autoscaler may add: admission and the 422 check count them)",
    )
    kuberay_rayjob_template: str = Field(
        "",
        description="Kueue mode: path of the RayJob template "
        "(ConfigMap ringtrain-rayjob-template); when set, every job runs as a KubeRay RayJob "
        "on its own cluster instead of on the shared cluster at ray_address",
    )
    kubernetes_api: str = Field(
        "", description="Kueue mode: the Kubernetes API URL (default: the pod's in-cluster one)"
    )
    kuberay_namespace: str = Field(
        "", description="Kueue mode: namespace of the RayJobs (default: the pod's own)"
    )
    driver_resources: dict[str, float] = Field(
        default_factory=dict,
        description="JSON object of custom Ray resources per driver (entrypoint_resources), "
        'e.g. {"ringtrain_driver": 1}: drivers then run only on nodes that advertise it '
        "(KubeRay: the drivers' group, never the head)",
    )
    queue_shrink_grace_s: float = Field(
        600.0,
        ge=0,
        description="a queued job larger than the cluster (nodes lost) "
        "fails after waiting this long",
    )
    leader_lease_s: float = Field(
        15.0,
        ge=1.0,
        description="replicas on one PostgreSQL store: the leader's lease; a dead leader is "
        "replaced within this long, a leader that cannot renew stops acting before it runs out",
    )
    migrate_on_start: bool = Field(
        True,
        description="`serve` upgrades the schema before it starts (`ringtrain db upgrade`); "
        "false where that is a step of its own (the Deployment's init container): the app then "
        "only checks the schema and refuses to start on an old one",
    )
    log_level: str = "INFO"
    # Opt-in tracking export (service.tracking; needs `pip install 'ringtrain[tracking]'`)
    mlflow_tracking_uri: str = Field(
        "", description="MLflow tracking URI; every job becomes a run (empty: off)"
    )
    mlflow_experiment: str = Field("ringtrain", description="MLflow experiment the runs go to")
    tensorboard_dir: str = Field(
        "", description="TensorBoard event files under <dir>/<job id>/ (empty: off)"
    )
    tracking_retry_max_s: float = Field(
        60.0, gt=0, description="longest wait between export retries in an outage"
    )
    # Rate limits: token buckets (sustained requests/s, burst); a rate of 0 switches that limit off.
    rate_limits: bool = Field(
        True, description="enforce the rate limits below (off: tests that measure capacity)"
    )
    rate_api_per_s: float = Field(20.0, ge=0, description="per API token, on the user routes")
    rate_api_burst: int = Field(200, ge=1)
    rate_report_per_s: float = Field(
        50.0, ge=0, description="per job, on the report route (drivers send ~5/s)"
    )
    rate_report_burst: int = Field(300, ge=1)
    rate_unauth_per_s: float = Field(
        2.0, ge=0, description="per client address, requests without a valid token"
    )
    rate_unauth_burst: int = Field(40, ge=1)
    audit_readers: list[str] = Field(
        default_factory=lambda: ["admin"],
        description="owners who may read every owner's audit rows",
    )

    @field_validator("api_tokens", mode="before")
    @classmethod
    def _tokens(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            if not v:
                return None
            v = json.loads(v)
        if isinstance(v, dict):
            out = {}
            for token, owner in v.items():
                if (
                    not isinstance(token, str)
                    or len(token) < 8
                    or not isinstance(owner, str)
                    or not owner
                ):
                    raise ValueError(
                        "api_tokens must map tokens (>= 8 characters) to non-empty owner names"
                    )
                if token.startswith(HASHED_PREFIX):
                    digest = token[len(HASHED_PREFIX) :].lower()
                    if not re.fullmatch(r"[0-9a-f]{64}", digest):
                        raise ValueError(
                            f"api_tokens: the entry of owner {owner!r} is not 'sha256:' and 64 "
                            "hex digits (the SHA-256 of the token: printf %s TOKEN | sha256sum)"
                        )
                    token = HASHED_PREFIX + digest
                out[token] = owner
            return out
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
    """The token → owner map. Unset: reuse or generate one admin token kept in `token_file`
    (mode 0600).

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
            print(
                f"ringtrain: generated admin API token (saved to {path}, mode 0600):\n  {token}",
                flush=True,
            )
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
