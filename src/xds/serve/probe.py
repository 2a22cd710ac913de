"""Link probing of the PD KV-transfer path (SPEC 11.1, P116; 11.3 "Link probing").

Heartbeats cannot see faults outside the DP masters' loops, such as a stalled KV transfer,
which is more often Decode saturation than a broken link. A probe injects a dummy payload into
a DistFlow pair's FIFO (:meth:`xds.serve.distflow.DistFlow.probe`) and classifies what happened
to it by ``timeout_ns``:

=====================================================  ==============
probe outcome                                          verdict
=====================================================  ==============
delivered within ``healthy_ns``                        HEALTHY
delivered later                                        SATURATED
taken by the link, delivery due after the timeout      SATURATED (the ports are busy
(queued behind the bytes of long transfers)            with transfers)
still behind transfers whose RECV Decode defers,       SATURATED
and no posted transfer held by the link
still queued while posted transfers are held by the    LINK_FAILURE
link, or at the head of the queue and not taken
=====================================================  ==============

Decode saturation delays the dummy; a link failure blocks every transfer, the dummy included.
:class:`LinkMonitor` probes every pair of a replay periodically and keeps the verdicts.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Annotated

import anyio
import msgspec
from msgspec import Meta

from ..config import check_fields
from ..docfields import document_fields
from ..runtime import emit, now_ns, sleep_ns
from ..units import MS, US
from .distflow import DistFlow, ProbeState


class LinkVerdict(enum.Enum):
    HEALTHY = "healthy"
    SATURATED = "saturated"
    LINK_FAILURE = "link_failure"


class ProbeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Probe timing ([emulator choice]: the paper gives none)."""

    timeout_ns: Annotated[int, Meta(gt=0)] = 100 * MS
    healthy_ns: Annotated[int, Meta(gt=0)] = 200 * US
    """Delivery within this is normal latency (a 64-byte DMA: start-up plus link latency)."""
    period_ns: Annotated[int, Meta(gt=0)] = 1_000 * MS
    """How often :class:`LinkMonitor` probes each pair."""
    nbytes: Annotated[int, Meta(ge=1)] = 64

    def __post_init__(self) -> None:
        check_fields(self)


class ProbeResult(msgspec.Struct, frozen=True, kw_only=True):
    pair: str
    sent_ns: int
    verdict: LinkVerdict
    latency_ns: int
    """Until delivery; -1 if not delivered before the timeout."""
    queued_ns: int
    """Spent behind transfers still waiting for their RECV (-1: still queued at the timeout)."""


async def link_probe(
    flow: DistFlow, config: ProbeConfig | None = None, *, decode_dp: int = 0, prefill_dp: int = 0
) -> ProbeResult:
    """Probe one DistFlow pair, from prefill DP ``prefill_dp`` to decode DP ``decode_dp``,
    and classify the outcome (table above)."""
    cfg = config or ProbeConfig()
    state = ProbeState()
    with anyio.move_on_after(cfg.timeout_ns / 1e9):
        await flow.probe(state, decode_dp=decode_dp, prefill_dp=prefill_dp, nbytes=cfg.nbytes)
    if state.delivered_ns >= 0:
        latency = state.delivered_ns - state.sent_ns
        verdict = LinkVerdict.HEALTHY if latency <= cfg.healthy_ns else LinkVerdict.SATURATED
    elif state.expected_ns >= 0:  # the link took it; busy ports put delivery past the timeout
        latency, verdict = -1, LinkVerdict.SATURATED
    elif state.on_wire_ns >= 0 or flow.stalled:  # refused by the link, or transfers held
        latency, verdict = -1, LinkVerdict.LINK_FAILURE
    else:  # behind RECVs Decode defers: saturation
        latency, verdict = -1, LinkVerdict.SATURATED
    result = ProbeResult(
        pair=flow.pair,
        sent_ns=state.sent_ns,
        verdict=verdict,
        latency_ns=latency,
        queued_ns=state.on_wire_ns - state.sent_ns if state.on_wire_ns >= 0 else -1,
    )
    emit("link-probe", verdict.value, pair=flow.pair, latency_ns=latency)
    return result


class LinkMonitor:
    """Probes DistFlow pairs every ``period_ns`` and keeps every result (run it as a task;
    cancel it when done). Pairs already out of service are not probed; ``on_result`` sees
    each result as it comes (the replay takes a LINK_FAILURE pair out of service)."""

    def __init__(
        self,
        flows: list[DistFlow],
        config: ProbeConfig | None = None,
        *,
        on_result: Callable[[DistFlow, ProbeResult], None] | None = None,
    ):
        self.flows = flows
        self.config = config or ProbeConfig()
        self.results: list[ProbeResult] = []
        self._on_result = on_result

    async def run(self) -> None:
        while True:
            start = now_ns()
            async with anyio.create_task_group() as tg:
                for flow in self.flows:
                    if not flow.failed:
                        tg.start_soon(self._one, flow)
            await sleep_ns(max(0, start + self.config.period_ns - now_ns()))

    async def _one(self, flow: DistFlow) -> None:
        result = await link_probe(flow, self.config)
        self.results.append(result)
        if self._on_result is not None:
            self._on_result(flow, result)


probe = link_probe
"""Short name of :func:`link_probe`."""

document_fields(ProbeConfig)
