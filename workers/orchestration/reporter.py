"""The driver's report channel to the control plane: `POST {control_url}/v1/jobs/{job_id}/report`.

Why it looks like this:
* Training must never wait for the control plane. `state()/metric()/log()` only append to an
  in-memory queue; a background thread POSTs batches and retries with capped exponential backoff
  while the API is unreachable.
* Sequence numbers are given when an item moves into the in-flight window, and the window keeps its
  numbers until the server's `ReportAck.acked_seq` covers them, so a batch whose response was lost
  is sent again unchanged (the server ignores seq ≤ its high-water mark: idempotent).
* The first request is a handshake (an empty batch): its ack is the server's high-water mark for the
  job, and numbering continues from there. So a re-submitted driver (a later attempt of the same
  job) never has its items silently ignored as duplicates of the previous driver's.
* A 409 (gap) carries the server's `acked_seq`: items up to it are dropped, the rest resent from
  there (if the server lost items we still held numbered above a gap, they are renumbered rather
  than retried forever).
* The queue is bounded: when full, new metric/log items are dropped (counted, and announced by a log
  line once there is room again); state items are never dropped. Unnumbered items never leave a gap
  in the sequence.
* `close()` flushes with a bounded wait, so a driver exits promptly even when the control plane is
  gone.
* A 409 `job_ended` means the job is terminal on the control plane (its token no longer reports):
  everything unsent is dropped and nothing more is queued, so the driver does not retry what can
  never be accepted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import httpx
import tenacity

from workers.protocol import (
    JobState,
    LogItem,
    MetricItem,
    MetricPoint,
    RankPlacement,
    ReportAck,
    StateItem,
)

log = logging.getLogger(__name__)

ReportItemT = MetricItem | StateItem | LogItem
_Factory = Callable[[int], ReportItemT]


class Reporter:
    def __init__(
        self,
        control_url: str,
        job_id: str,
        token: str,
        *,
        max_batch: int = 1000,
        max_queue: int = 200_000,
        interval_s: float = 0.2,
        request_timeout_s: float = 10.0,
        backoff_max_s: float = 2.0,
        handshake: bool = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = f"{control_url.rstrip('/')}/v1/jobs/{job_id}/report"
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._queue: deque[tuple[_Factory, bool]] = (
            deque()
        )  # (factory, droppable), not numbered yet
        self._window: list[
            ReportItemT
        ] = []  # numbered, sent at least once or about to be, not acked
        self._next_seq = 1
        self.acked_seq = 0
        self._handshake_done = not handshake
        self._max_batch = max_batch
        self._limit = max_batch  # shrinks to isolate an item the server refuses (413/422)
        self._max_queue = max_queue
        self._interval_s = interval_s
        self._backoff_max_s = backoff_max_s
        self._cond = threading.Condition()
        self._closing = False
        self._dropped = 0
        self.failures = 0  # consecutive failed requests
        self.delivered = 0  # items acknowledged so far
        self.last_error: str | None = None
        self.ended: str | None = (
            None  # the terminal state the control plane answered with (409 job_ended)
        )
        self._client = httpx.Client(timeout=request_timeout_s, transport=transport)
        self._thread = threading.Thread(target=self._run, name="ringtrain-reporter", daemon=True)
        self._thread.start()

    # -- producer side: never touches the network --------------------------------------------------
    def _enqueue(self, factory: _Factory, droppable: bool) -> bool:
        with self._cond:
            if self.ended:
                return False
            if droppable and len(self._queue) >= self._max_queue:
                self._dropped += 1
                return False
            if self._dropped and (not droppable or len(self._queue) < self._max_queue // 2):
                n, self._dropped = self._dropped, 0
                msg = f"report queue full: dropped {n} metric/log items"
                self._queue.append(
                    (lambda s: LogItem(seq=s, time=time.time(), source="driver", line=msg), False)
                )
            self._queue.append((factory, droppable))
            self._cond.notify_all()
            return True

    def state(
        self,
        state: JobState,
        reason: str = "",
        *,
        placement: list[RankPlacement] | None = None,
        resume_step: int | None = None,
        error: str | None = None,
        metadata: dict[str, str | int | float | bool] | None = None,
    ) -> None:
        now = time.time()
        self._enqueue(
            lambda s: StateItem(
                seq=s,
                state=state,
                reason=reason[:4000],
                time=now,
                placement=placement,
                resume_step=resume_step,
                error=error[:20000] if error else None,
                metadata=metadata,
            ),
            droppable=False,
        )

    def metric(self, point: MetricPoint, *, replay: bool = False) -> bool:
        """Queue a point; `replay`: re-sent after a failure (the server skips it if it already holds
        it). Replays are never dropped: they are what a retry must not lose."""
        data = point.model_dump()
        return self._enqueue(
            lambda s: MetricItem(seq=s, replay=replay, **data), droppable=not replay
        )

    def log(self, line: str, source: str = "driver") -> bool:
        now = time.time()
        return self._enqueue(
            lambda s: LogItem(seq=s, time=now, source=source[:100], line=line[:20000]), True
        )

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + len(self._window)

    # -- sender thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        send = tenacity.Retrying(
            wait=tenacity.wait_exponential(
                multiplier=0.1, max=self._backoff_max_s
            ),  # 0.1 s, doubling, capped
            retry=tenacity.retry_if_result(lambda ok: not ok),
            stop=lambda _: self._closing,
            sleep=self._pause,
            retry_error_callback=lambda _: False,  # closing while the control plane is unreachable
        )
        while True:
            with self._cond:
                while (
                    not self._closing
                    and not self._queue
                    and not self._window
                    and self._handshake_done
                ):
                    self._cond.wait(timeout=self._interval_s)
                if self._closing and not self._queue and not self._window:
                    return
                if self._handshake_done:
                    while self._queue and len(self._window) < self._max_batch:
                        factory, _ = self._queue.popleft()
                        self._window.append(factory(self._next_seq))
                        self._next_seq += 1
            if not send(self._send_window):
                return
            with self._cond:  # let a few items gather unless there is a backlog
                if self.pending() < self._max_batch and not self._closing:
                    self._cond.wait(timeout=self._interval_s)

    def _pause(self, seconds: float) -> None:
        """Back-off sleep that `close()` cuts short."""
        with self._cond:
            if not self._closing:
                self._cond.wait(timeout=seconds)

    def _send_window(self) -> bool:
        with self._cond:
            batch = self._window[: self._limit]
        return self._post(batch)

    def _post(self, batch: list[ReportItemT]) -> bool:
        body = '{"items":[' + ",".join(it.model_dump_json() for it in batch) + "]}"
        try:
            resp = self._client.post(self.url, content=body, headers=self._headers)
        except httpx.HTTPError as e:
            return self._fail(f"{type(e).__name__}: {e}")
        if resp.status_code == 409 and _error_code(resp) == "job_ended":
            return self._job_ended(resp)
        if resp.status_code == 409:
            try:
                acked = int(resp.json()["acked_seq"])
            except Exception:
                return self._fail(f"409 without acked_seq: {resp.text[:200]}")
            self._ack(acked, rebase=True)
            return True  # resend from acked + 1 at once
        if (
            not batch and resp.status_code == 422
        ):  # a server that refuses empty batches: assume a fresh job
            self._ack(0, rebase=False)
            return True
        if resp.status_code in (400, 413, 422) and batch:
            return self._refused(batch, resp)
        if resp.status_code >= 300:
            return self._fail(f"HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            ack = ReportAck.model_validate_json(resp.content)
        except Exception as e:
            return self._fail(f"bad ack: {e}")
        self._ack(ack.acked_seq, rebase=not batch)
        self.failures = 0
        self._limit = min(self._max_batch, self._limit * 2)
        return True

    def _refused(self, batch: list[ReportItemT], resp: httpx.Response) -> bool:
        """The server rejects the batch itself (too large, or an item it cannot accept): halve the
        batch until a single item is refused, then drop that item and renumber the rest so the
        sequence stays gap-free."""
        if len(batch) > 1:
            self._limit = max(1, len(batch) // 2)
            return True
        with self._cond:
            if self._window and self._window[0].seq == batch[0].seq:
                bad = self._window.pop(0)
                self._window = [it.model_copy(update={"seq": it.seq - 1}) for it in self._window]
                self._next_seq -= 1
                log.error(
                    "control plane refused report item %s (HTTP %d: %s); dropped it",
                    bad.model_dump_json()[:300],
                    resp.status_code,
                    resp.text[:300],
                )
        return True

    def _ack(self, acked: int, *, rebase: bool) -> None:
        with self._cond:
            if not self._handshake_done:
                self._handshake_done = True
                self._next_seq = acked + 1
                if acked:
                    log.info("continuing the job's report sequence after %d", acked)
            before = len(self._window)
            self._window = [it for it in self._window if it.seq > acked]
            self.delivered += before - len(self._window)
            self.acked_seq = max(self.acked_seq, acked)
            if rebase and self._window and self._window[0].seq != acked + 1:
                log.warning(
                    "server is at seq %d, our oldest unacked item is %d: renumbering",
                    acked,
                    self._window[0].seq,
                )
                self._window = [
                    it.model_copy(update={"seq": acked + 1 + i})
                    for i, it in enumerate(self._window)
                ]
                self._next_seq = acked + 1 + len(self._window)
            self._cond.notify_all()

    def _job_ended(self, resp: httpx.Response) -> bool:
        with self._cond:
            dropped = len(self._queue) + len(self._window)
            self._queue.clear()
            self._window.clear()
            try:
                self.ended = str(resp.json().get("state") or "ended")
            except Exception:
                self.ended = "ended"
            self.last_error = f"the job has ended ({self.ended}) on the control plane"
            self._cond.notify_all()
        log.info("%s: dropped %d unsent report item(s)", self.last_error, dropped)
        return True

    def _fail(self, msg: str) -> bool:
        self.failures += 1
        if self.failures == 1 or self.failures % 50 == 0:
            log.warning("report to %s failed (%d in a row): %s", self.url, self.failures, msg)
        self.last_error = msg
        return False

    # -- shutdown ----------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far is acknowledged (or the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.notify_all()
            while self._queue or self._window:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 0.1))
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Flush with a bounded wait, then stop the sender. Returns whether all was delivered."""
        delivered = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=self._client.timeout.read or 10.0)
        self._client.close()
        return delivered


def _error_code(resp: httpx.Response) -> str | None:
    try:
        return str(resp.json()["error"]["code"])
    except Exception:
        return None
