"""A typed Python client for the ringtrain REST API (httpx).

    from api.client import Client

    c = Client()                             # RINGTRAIN_URL / RINGTRAIN_TOKEN / ~/.ringtrain/token
    job = c.submit("examples/passkey.yaml")  # path, YAML/JSON text, dict or JobSpec
    for ev in c.events(job.id):              # replays, then live; resumes after a disconnect
        if ev.event == "metric" and ev.data["name"] == "loss":
            print(ev.data["step"], ev.data["value"])
    print(c.get_job(job.id).state)

Errors raise `ApiError` with the server's `code`, `message` and offending `field`.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
from httpx_sse import ServerSentEvent, connect_sse
from httpx_sse._decoders import SSEDecoder  # the decoder EventSource uses; parse_sse feeds it lines
from pydantic import TypeAdapter
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from api.schemas import ClusterOut, JobList, JobOut, LogPage, MetricOut, MetricPage, PlanOut
from service.settings import DEFAULT_TOKEN_FILE, read_token_file
from workers.config import JobSpec

if TYPE_CHECKING:
    from api.routers.artifacts import ArtifactList
    from api.routers.metrics import MetricCatalog

DEFAULT_URL = "http://127.0.0.1:8000"
Verified = Literal["passed", "failed"]  # `GET /v1/jobs?verification=`


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        details: list[Any] | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.details = details or []
        self.body = body


@dataclass(frozen=True)
class JobEvent:
    """One SSE message: `event` is state, metric, log or end; `id` is the event seq (None for
    end)."""

    event: str
    id: int | None
    data: dict[str, Any]


def resolve_url(url: str | None = None) -> str:
    return (url or os.environ.get("RINGTRAIN_URL") or DEFAULT_URL).rstrip("/")


def resolve_token(token: str | None = None) -> str | None:
    return (
        token
        or os.environ.get("RINGTRAIN_TOKEN")
        or read_token_file(Path(os.environ.get("RINGTRAIN_TOKEN_FILE", str(DEFAULT_TOKEN_FILE))))
    )


def spec_body(spec: str | Path | dict[str, Any] | JobSpec) -> tuple[bytes, str]:
    """(body, content type) for a spec given as a path, YAML/JSON text, a dict or a JobSpec."""
    if isinstance(spec, JobSpec):
        return spec.model_dump_json().encode(), "application/json"
    if isinstance(spec, dict):
        return json.dumps(spec).encode(), "application/json"
    if isinstance(spec, Path) or (
        isinstance(spec, str)
        and "\n" not in spec
        and len(spec) < 4096
        and Path(spec).expanduser().is_file()
    ):
        p = Path(spec).expanduser()
        text = p.read_text()
        ctype = "application/json" if p.suffix == ".json" else "application/yaml"
        return text.encode(), ctype
    text = str(spec)
    return text.encode(), "application/json" if text.lstrip().startswith(
        "{"
    ) else "application/yaml"


class Client:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = resolve_url(url)
        self.token = resolve_token(token)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing -------------------------------------------------------------------------------
    def _check(self, r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                body = r.json()
                err = body.get("error", {})
            except ValueError:
                body, err = r.text, {}
            raise ApiError(
                r.status_code,
                err.get("code", "http_error"),
                err.get("message", r.text[:500]),
                err.get("field"),
                err.get("details"),
                body,
            )
        return r.json() if r.content else None

    def _get(self, path: str, **params: Any) -> Any:
        return self._check(
            self.http.get(path, params={k: v for k, v in params.items() if v is not None})
        )

    # ---- endpoints ------------------------------------------------------------------------------
    def submit(self, spec: str | Path | dict[str, Any] | JobSpec) -> JobOut:
        body, ctype = spec_body(spec)
        return JobOut.model_validate(
            self._check(self.http.post("/v1/jobs", content=body, headers={"Content-Type": ctype}))
        )

    def plan(
        self,
        spec: str | Path | dict[str, Any] | JobSpec,
        *,
        fit: bool = False,
        memory_per_rank_gib: float | None = None,
    ) -> PlanOut:
        """Dry run; with `fit` (or a budget) `spec` in the answer is the spec fit chose (`fit`)."""
        body, ctype = spec_body(spec)
        params: dict[str, Any] = {}
        if fit or memory_per_rank_gib is not None:
            params["fit"] = "true"
        if memory_per_rank_gib is not None:
            params["fit_memory_per_rank_gib"] = memory_per_rank_gib
        r = self.http.post("/v1/plan", content=body, headers={"Content-Type": ctype}, params=params)
        return TypeAdapter(PlanOut).validate_python(self._check(r))

    def list_jobs(
        self,
        state: str | list[str] | None = None,
        limit: int = 50,
        offset: int = 0,
        verification: Verified | None = None,
    ) -> JobList:
        """Your jobs, newest first; `verification` keeps those whose pre-training check passed or
        failed (jobs that have not verified, or have it disabled, match neither)."""
        return JobList.model_validate(
            self._get(
                "/v1/jobs", state=state, limit=limit, offset=offset, verification=verification
            )
        )

    def get_job(self, job_id: str) -> JobOut:
        return JobOut.model_validate(self._get(f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> JobOut:
        return JobOut.model_validate(self._check(self.http.post(f"/v1/jobs/{job_id}/cancel")))

    def metrics(
        self, job_id: str, after: int = 0, limit: int = 1000, names: list[str] | None = None
    ) -> MetricPage:
        return MetricPage.model_validate(
            self._get(f"/v1/jobs/{job_id}/metrics", after=after, limit=limit, name=names)
        )

    def iter_metrics(
        self, job_id: str, names: list[str] | None = None, after: int = 0
    ) -> Iterator[MetricOut]:
        """Every stored point, following pages."""
        while True:
            page = self.metrics(job_id, after=after, names=names)
            yield from page.points
            if not page.has_more:
                return
            after = page.next_after

    def logs(self, job_id: str, after: int = 0, limit: int = 1000, driver: bool = True) -> LogPage:
        return LogPage.model_validate(
            self._get(
                f"/v1/jobs/{job_id}/logs", after=after, limit=limit, driver=str(driver).lower()
            )
        )

    def artifacts(self, job_id: str) -> ArtifactList:
        """The job's exported model files (name, size, SHA-256); ApiError 404 until the job has
        exported one."""
        from api.routers.artifacts import ArtifactList

        return ArtifactList.model_validate(self._get(f"/v1/jobs/{job_id}/artifacts"))

    def pull(
        self, job_id: str, dest: str | Path, progress: Callable[[str, int, int], None] | None = None
    ) -> list[Path]:
        """Download the exported model into `dest`, every file checked against its SHA-256
        (`api.pull`)."""
        from api.pull import pull

        return pull(self.http, self.artifacts(job_id), dest, self._check, progress)

    def metric_catalog(self) -> MetricCatalog:
        """What each metric name means and how to show it (`GET /v1/metrics/catalog`)."""
        from api.routers.metrics import MetricCatalog

        return MetricCatalog.model_validate(self._get("/v1/metrics/catalog"))

    def cluster(self) -> ClusterOut:
        return ClusterOut.model_validate(self._get("/v1/cluster"))

    def data_roots(self) -> list[str]:
        """The folders the server lets jobs and datasets read and write (`RINGTRAIN_DATA_ROOTS`)."""
        return list(self._get("/v1/datasets/roots")["data_roots"])

    def create_eval(
        self,
        lengths: list[int],
        *,
        model: str | None = None,
        job: str | None = None,
        samples: int = 4,
        ring_size: int = 1,
        seed: int = 0,
        tasks: list[str] | None = None,
        suite: str = "ruler",
    ) -> dict[str, Any]:
        """Start a RULER-style evaluation of `model` (a directory on the cluster, inside the
        server's data roots) or of `job`'s exported model, on the server's cluster."""
        body: dict[str, Any] = {
            "suite": suite,
            "lengths": lengths,
            "samples": samples,
            "ring_size": ring_size,
            "seed": seed,
        }
        body.update({k: v for k, v in (("model", model), ("job", job), ("tasks", tasks)) if v})
        out: dict[str, Any] = self._check(self.http.post("/v1/evals", json=body))
        return out

    def list_evals(self) -> list[dict[str, Any]]:
        """Your evaluations, newest first."""
        out: list[dict[str, Any]] = self._get("/v1/evals")
        return out

    def get_eval(self, eval_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self._get(f"/v1/evals/{eval_id}")
        return out

    def wait_eval(
        self, eval_id: str, timeout: float | None = None, poll_s: float = 1.0
    ) -> dict[str, Any]:
        """Poll until the evaluation SUCCEEDED or FAILED."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ev = self.get_eval(eval_id)
            if ev["state"] in ("SUCCEEDED", "FAILED"):
                return ev
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"eval {eval_id} still {ev['state']} after {timeout}s")
            time.sleep(poll_s)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = self._get("/healthz")
        return out

    def ready(self) -> dict[str, Any]:
        out: dict[str, Any] = self._get("/readyz")
        return out

    def wait(self, job_id: str, timeout: float | None = None, poll_s: float = 1.0) -> JobOut:
        """Poll until the job is terminal."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get_job(job_id)
            if job.state.terminal:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state} after {timeout}s")
            time.sleep(poll_s)

    def events(
        self,
        job_id: str,
        after: int | None = None,
        *,
        reconnect: bool = True,
        max_retries: int = 20,
        read_timeout: float = 60.0,
    ) -> Iterator[JobEvent]:
        """The job's events, replayed then live, until the job ends (`end` is yielded last).

        A dropped connection is resumed from the last seen id (`Last-Event-ID`), so nothing is lost
        or repeated. A connection that ends before delivering an event is a failure: up to
        `max_retries` of them in a row are retried with exponential back-off; one that delivered
        events reconnects at once.
        """
        last = after
        retrying = Retrying(
            retry=retry_if_exception_type(_StreamLost),
            wait=wait_exponential(multiplier=0.4, max=5.0),
            stop=stop_after_attempt(1 + (max_retries if reconnect else 0)),
            reraise=True,
        )
        while True:
            try:
                for attempt in retrying:  # each pass over `retrying` starts a fresh count
                    with attempt:
                        stream = self._event_stream(job_id, last, read_timeout)
                        first = next(
                            stream
                        )  # _StreamLost when the connection ends before its first event
            except _StreamLost as e:
                if not reconnect:
                    return
                raise ApiError(
                    0,
                    "disconnected",
                    f"lost the event stream of {job_id} {max_retries + 1} times in a row",
                ) from e
            try:
                for ev in itertools.chain([first], stream):
                    if ev.id is not None:
                        last = ev.id
                    yield ev
                    if ev.event == "end":
                        return
            except _StreamLost:
                if not reconnect:
                    return
            finally:
                stream.close()

    def _event_stream(
        self, job_id: str, after: int | None, read_timeout: float
    ) -> Generator[JobEvent]:
        """One connection's events (httpx-sse does the framing); raises _StreamLost if it ends
        before `end`."""
        headers = {} if after is None else {"Last-Event-ID": str(after)}
        timeout = httpx.Timeout(10.0, read=read_timeout)
        try:
            with connect_sse(
                self.http, "GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=timeout
            ) as es:
                if es.response.status_code >= 400:
                    es.response.read()
                    self._check(es.response)
                for sse in es.iter_sse():
                    if sse.data:
                        yield job_event(sse)
                        if sse.event == "end":
                            return
        except httpx.TransportError as e:
            raise _StreamLost(str(e)) from e
        raise _StreamLost("the server closed the stream before the job ended")


class _StreamLost(Exception):
    """The event stream ended before the job's `end` event (a dropped or closed connection)."""


def job_event(sse: ServerSentEvent) -> JobEvent:
    """A JobEvent from one SSE message; `end` carries no id of its own (httpx-sse repeats the last
    one seen)."""
    try:
        data = json.loads(sse.data)
    except ValueError:
        data = {"raw": sse.data}
    eid = int(sse.id) if sse.event != "end" and sse.id.isdigit() else None
    return JobEvent(sse.event or "message", eid, data)


def parse_sse(lines: Iterable[str]) -> Iterator[JobEvent]:
    """JobEvents from raw SSE lines (e.g. `response.iter_lines()`), decoded by httpx-sse's
    decoder."""
    decoder = SSEDecoder()
    for line in lines:
        sse = decoder.decode(line.rstrip("\r\n"))
        if sse is not None and sse.data:
            yield job_event(sse)
