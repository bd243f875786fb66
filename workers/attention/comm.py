"""Ring communication: pass a buffer to the next rank while receiving from the previous one.

`RingComm.send_recv` posts both with `batch_isend_irecv` and returns at once, so the caller can
compute on the current block while the next one is in flight; `wait()` returns the received buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingComm:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        to_global = (
            (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        )
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)
        self._reqs: list[dist.Work] = []
        self._recv: torch.Tensor | None = None
        self._send: torch.Tensor | None = None

    def send_recv(self, send: torch.Tensor) -> None:
        """Post: send `send` to the next rank, receive one shaped like it from the previous rank."""
        if self._reqs:
            raise RuntimeError("wait() for the pending exchange before posting another")
        send = send.contiguous()
        self._recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, self._recv, self.prev, self.group),
        ]
        self._reqs = dist.batch_isend_irecv(ops)
        self._send = send  # keep alive until the send completes

    def wait(self) -> torch.Tensor:
        for req in self._reqs:
            req.wait()
        self._reqs = []
        recv, self._recv, self._send = self._recv, None, None
        assert recv is not None
        return recv
