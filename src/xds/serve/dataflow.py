"""Dataflow serving: barrier-free A2E/E2A (SPEC 10.4, P092/P112; an optional mode).

The paper's vision: as long as global synchronisation sits on the data path, one slow or
failed component stalls everything; instead, tensors should flow asynchronously between
components. This module runs MoE-attention disaggregated decode both ways on a small content
model, so the two can be compared token for token and in time:

* ``mode = "sync"``: every layer is a global step. Each attention worker sends its batch's
  token copies (A2E), waits for every result (E2A), and no worker starts the next layer before
  all have finished this one (a barrier), as A2E/E2A do today.
* ``mode = "dataflow"``: no barrier anywhere. Every token copy is a message tagged (request,
  position, layer, slot, epoch). An expert processes whatever has arrived; a token advances to
  layer l+1 as soon as all k of its layer-l results are present; a sequence samples its next
  token as soon as its last layer is done; a worker admits a new request as soon as a slot is
  free (decentralised, event-driven admission).

Queues are bounded (``queue_depth`` messages per inbox and per link): a full queue blocks the
sender, so backpressure propagates back to the token that produced the message instead of
dropping it. Each token's copies are sent by their own task, so a slow destination holds up
only the tokens that need it (no head-of-line blocking). Links may duplicate messages
(``duplicate_probability``, seeded); a result is applied at most once, identified by its tag,
at the point where it is combined. Components can be slowed (:class:`ComponentDelay`).

Invariants (tested): the tokens equal the synchronous run's and a dense reference's; no tag is
applied twice; no queue exceeds its bound; with a slow component nothing deadlocks, and in
dataflow mode only the requests that depend on it slow down.
"""

from __future__ import annotations

from typing import Annotated, Literal

import anyio
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from msgspec import Meta

from ..config import check_fields, require_instance, require_int
from ..docfields import document_fields
from ..errors import ConfigError
from ..model.reference_moe import ReferenceMoE, TinyMoE
from ..runtime import Barrier, emit, now_ns, rng, sleep_ns
from ..runtime.rng import RngStreams
from ..runtime.sync import Streams
from ..units import US


class ComponentDelay(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Slow one component: ``"attention:<i>"`` adds ``extra_ns`` to each of its compute steps,
    ``"expert:<j>"`` to each token copy it computes, while ``from_ns <= now < until_ns``."""

    component: str
    extra_ns: Annotated[int, Meta(ge=0)]
    from_ns: Annotated[int, Meta(ge=0)] = 0
    until_ns: Annotated[int, Meta(ge=0)] = 2**62

    def __post_init__(self) -> None:
        check_fields(self)
        kind, _, index = self.component.partition(":")
        canonical = index.isascii() and index.isdigit() and str(int(index)) == index
        if kind not in ("attention", "expert") or not canonical:
            raise ConfigError(
                f"component must be 'attention:<i>' or 'expert:<j>' (i, j plain decimal "
                f"numbers), got {self.component!r}",
                field="component",
            )
        if self.until_ns <= self.from_ns:
            raise ConfigError(
                f"until_ns ({self.until_ns}) must be after from_ns ({self.from_ns})",
                field="until_ns",
            )


class DataflowConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A small MoE-attention disaggregated decode deployment and its workload."""

    mode: Literal["dataflow", "sync"] = "dataflow"
    attention_workers: Annotated[int, Meta(ge=1)] = 4
    expert_workers: Annotated[int, Meta(ge=1)] = 6
    batch_per_worker: Annotated[int, Meta(ge=1)] = 4
    requests: Annotated[int, Meta(ge=1)] = 32
    prompt_tokens: Annotated[int, Meta(ge=1)] = 4
    output_tokens: Annotated[int, Meta(ge=1)] = 8
    layers: Annotated[int, Meta(ge=1)] = 2
    experts: Annotated[int, Meta(ge=1)] = 12
    top_k: Annotated[int, Meta(ge=1)] = 2
    hidden: Annotated[int, Meta(ge=2)] = 16
    vocab: Annotated[int, Meta(ge=2)] = 64
    queue_depth: Annotated[int, Meta(ge=1)] = 8
    """Messages each inbox and each link holds before its sender blocks."""
    attention_ns: Annotated[int, Meta(ge=0)] = 20 * US
    """One token's attention, gating and combine at one layer on an attention worker."""
    expert_ns: Annotated[int, Meta(ge=0)] = 5 * US
    """One token copy through one expert."""
    link_ns: Annotated[int, Meta(ge=0)] = 3 * US
    """One message across the fabric."""
    duplicate_probability: Annotated[float, Meta(ge=0, le=1)] = 0.0
    delays: tuple[ComponentDelay, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.top_k > self.experts:
            raise ConfigError(
                f"top_k {self.top_k} exceeds the {self.experts} experts", field="top_k"
            )
        for i, d in enumerate(self.delays):
            if not isinstance(d, ComponentDelay):
                raise ConfigError(
                    f"expected a ComponentDelay, got {type(d).__name__}", field=f"delays[{i}]"
                )
            kind, _, index = d.component.partition(":")
            count = self.attention_workers if kind == "attention" else self.expert_workers
            if int(index) >= count:
                raise ConfigError(
                    f"{d.component}: there are {count} {kind} workers",
                    field=f"delays[{i}].component",
                )


class RequestResult(msgspec.Struct, frozen=True):
    request: int
    worker: int
    tokens: list[int]
    admitted_ns: int
    finished_ns: int


class DataflowResult(msgspec.Struct, kw_only=True):
    requests: list[RequestResult]
    elapsed_ns: int
    messages: int
    """Token copies and results sent (a link's duplicate is not counted, but an expert that
    computes a duplicated copy sends one more result)."""
    duplicates_sent: int
    duplicates_dropped: int
    """Results discarded by their tag (applied at most once). ``duplicates_sent`` exceeds it
    by the duplicates still on their way when the last request finished."""
    max_queue: dict[str, int]
    """Largest occupancy seen per kind of queue (``inbox``, ``link``); never above
    ``queue_depth``."""


class _Message(msgspec.Struct, frozen=True):
    tag: tuple[int, int, int, int, int]
    """(request, position, layer, slot, epoch)."""
    worker: int
    """The attention worker that owns the token."""
    expert: int
    x: np.ndarray


class _Model:
    """Embedding, per layer an attention step over the sequence's own history and a top-k MoE
    (:class:`~xds.model.ReferenceMoE`), LM head. Float32, fixed accumulation order."""

    def __init__(self, cfg: DataflowConfig, gen: np.random.Generator):
        h = cfg.hidden
        shape = TinyMoE(
            hidden=h, intermediate=max(2, h // 2), n_experts=cfg.experts, top_k=cfg.top_k
        )
        self.moe = [ReferenceMoE(shape, gen) for _ in range(cfg.layers)]
        self.embed = gen.standard_normal((cfg.vocab, h)).astype(np.float32)
        self.head = gen.standard_normal((h, cfg.vocab)).astype(np.float32)

    @staticmethod
    def attend(x: np.ndarray, history: list[np.ndarray]) -> np.ndarray:
        """This layer's attention: the token and the mean of its sequence's layer inputs."""
        return (x + np.tanh(np.mean(np.stack(history), axis=0, dtype=np.float32))).astype(
            np.float32
        )

    def combine(self, x: np.ndarray, w: np.ndarray, outs: list[np.ndarray]) -> np.ndarray:
        y = np.zeros_like(x)
        for j, out in enumerate(outs):  # top-k order, whatever order the results came in
            y += w[j] * out
        return (x + y).astype(np.float32)

    def sample(self, x: np.ndarray) -> int:
        return int(np.argmax(x @ self.head))


def reference_tokens(
    config: DataflowConfig, *, run_seed: int | None = None, model_seed: int | None = None
) -> list[list[int]]:
    """Every request's tokens computed densely, one token at a time (the ground truth): those
    of ``Dataflow(config)`` in a run of seed ``run_seed``, or of ``Dataflow(config,
    model_seed=...)`` in any run. Give exactly one."""
    if (run_seed is None) == (model_seed is None):
        raise ConfigError(
            "give run_seed (the seed of the run Dataflow(config) runs in) or model_seed (the "
            "model_seed Dataflow was given), one of them",
            field="run_seed",
        )
    gen = _model_gen(run_seed or 0, model_seed)
    model = _Model(config, gen)
    prompts = _prompts(config, gen)
    out = []
    for prompt in prompts:
        history: list[list[np.ndarray]] = [[] for _ in range(config.layers)]
        tokens = list(prompt)
        generated: list[int] = []
        for pos in range(len(prompt) + config.output_tokens - 1):
            x = model.embed[tokens[pos]]
            for layer in range(config.layers):
                history[layer].append(x)
                x = model.attend(x, history[layer])
                idx, w = model.moe[layer].route(x[None, :])
                outs = [model.moe[layer].expert(int(e), x[None, :])[0] for e in idx[0]]
                x = model.combine(x, w[0], outs)
            if pos >= len(prompt) - 1:
                nxt = model.sample(x)
                generated.append(nxt)
                tokens.append(nxt)
        out.append(generated)
    return out


def _prompts(cfg: DataflowConfig, gen: np.random.Generator) -> list[list[int]]:
    return [
        [int(t) for t in gen.integers(0, cfg.vocab, cfg.prompt_tokens)] for _ in range(cfg.requests)
    ]


class _Sequence:
    __slots__ = (
        "admitted_ns",
        "history",
        "pending",
        "position",
        "ready_layer",
        "request",
        "tokens",
        "worker",
        "x",
    )

    def __init__(self, request: int, worker: int, prompt: list[int], layers: int):
        self.request = request
        self.worker = worker
        self.tokens = list(prompt)
        self.position = 0
        self.history: list[list[np.ndarray]] = [[] for _ in range(layers)]
        self.pending: dict[int, np.ndarray] = {}
        """Slot -> expert output of the layer in flight."""
        self.x = np.zeros(0, np.float32)
        self.admitted_ns = 0
        self.ready_layer = 0
        """The layer the token is ready for (``layers``: every layer of it is done)."""


def _model_gen(seed: int, model_seed: int | None) -> np.random.Generator:
    """The content model's generator: the ``dataflow/model`` stream of a run of ``seed``, or
    one of its own seeded ``model_seed`` (the same model whatever the run's seed)."""
    if model_seed is not None:
        return np.random.default_rng(model_seed)
    return np.random.Generator(np.random.PCG64(RngStreams(seed).seed_sequence("dataflow/model")))


class Dataflow:
    """Run with ``await Dataflow(config).run()`` inside :func:`xds.run`; the content model and
    prompts come from the run's ``rng("dataflow/model")`` stream, or from ``model_seed``
    (:func:`reference_tokens` with the run's seed, or the same ``model_seed``, gives the
    tokens they must produce)."""

    def __init__(self, config: DataflowConfig, *, model_seed: int | None = None):
        require_instance(config, DataflowConfig, "config")
        if model_seed is not None:
            model_seed = require_int(model_seed, "model_seed")
        self.config = config
        cfg = config
        gen = rng("dataflow/model") if model_seed is None else np.random.default_rng(model_seed)
        self.model = _Model(cfg, gen)
        self.prompts = _prompts(cfg, gen)
        self._dup = rng("dataflow/duplicates")
        self.results: dict[int, RequestResult] = {}
        self.messages = 0
        self.duplicates_sent = 0
        self.duplicates_dropped = 0
        self.max_queue = {"inbox": 0, "link": 0}
        depth = cfg.queue_depth
        self._streams = Streams()
        """Every stream of the run (closed when it ends)."""
        self._expert_in = [self._streams.create(_Message, depth) for _ in range(cfg.expert_workers)]
        self._attention_in = [
            self._streams.create(_Message, depth) for _ in range(cfg.attention_workers)
        ]
        self._admission = list(range(cfg.requests))
        self._layer: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        """(request, layer) -> (expert ids, weights) of the token in flight."""
        self._seqs: dict[int, _Sequence] = {}
        self._done = anyio.Event()
        self._work: list[MemoryObjectSendStream[_Sequence]] = []
        self._links: dict[tuple[str, int, int], MemoryObjectSendStream[_Message]] = {}

    # -- the run ------------------------------------------------------------------------------
    async def run(self) -> DataflowResult:
        start = now_ns()
        try:
            await self._run()
        finally:
            self._streams.close()
        return DataflowResult(
            requests=[self.results[r] for r in sorted(self.results)],
            elapsed_ns=now_ns() - start,
            messages=self.messages,
            duplicates_sent=self.duplicates_sent,
            duplicates_dropped=self.duplicates_dropped,
            max_queue=dict(self.max_queue),
        )

    async def _run(self) -> None:
        cfg = self.config
        async with anyio.create_task_group() as tg:
            for j in range(cfg.expert_workers):
                tg.start_soon(self._expert, j, name=f"expert-{j}")
                for i in range(cfg.attention_workers):
                    self._links[("e2a", j, i)] = self._link(
                        tg, self._attention_in[i][0], f"e2a-{j}-{i}"
                    )
                    self._links[("a2e", i, j)] = self._link(
                        tg, self._expert_in[j][0], f"a2e-{i}-{j}"
                    )
            if cfg.mode == "dataflow":
                for i in range(cfg.attention_workers):
                    send, recv = self._streams.create(_Sequence, float("inf"))
                    self._work.append(send)
                    tg.start_soon(self._attention_dataflow, i, recv, name=f"attention-{i}")
                    tg.start_soon(self._receiver, i, name=f"attention-{i}-inbox")
            else:
                barrier = Barrier(cfg.attention_workers)
                for i in range(cfg.attention_workers):
                    tg.start_soon(self._attention_sync, i, barrier, name=f"attention-{i}")
            await self._done.wait()
            tg.cancel_scope.cancel()

    def _link(
        self, tg, dst: MemoryObjectSendStream[_Message], name: str
    ) -> MemoryObjectSendStream[_Message]:
        """A bounded link: messages cross it in order after ``link_ns``, maybe twice."""
        send, recv = self._streams.create(_Message, self.config.queue_depth)
        tg.start_soon(self._carry, recv, dst, name=name)
        return send

    async def _carry(
        self, recv: MemoryObjectReceiveStream[_Message], dst: MemoryObjectSendStream[_Message]
    ) -> None:
        cfg = self.config
        async for msg in recv:
            await sleep_ns(cfg.link_ns)
            copies = 1
            if cfg.duplicate_probability and self._dup.random() < cfg.duplicate_probability:
                copies = 2
                self.duplicates_sent += 1
            for _ in range(copies):
                await dst.send(msg)  # blocks while the destination's inbox is full
                self._note("inbox", dst)

    def _note(self, kind: str, stream) -> None:
        used = stream.statistics().current_buffer_used
        if used > self.max_queue[kind]:
            self.max_queue[kind] = used

    def _extra(self, component: str) -> int:
        t = now_ns()
        return sum(
            d.extra_ns
            for d in self.config.delays
            if d.component == component and d.from_ns <= t < d.until_ns
        )

    # -- experts --------------------------------------------------------------------------------
    async def _expert(self, j: int) -> None:
        """Process whatever has arrived, one token copy at a time."""
        cfg = self.config
        async for msg in self._expert_in[j][1]:
            layer = msg.tag[2]
            await sleep_ns(cfg.expert_ns + self._extra(f"expert:{j}"))
            out = self.model.moe[layer].expert(msg.expert, msg.x[None, :])[0]
            reply = msgspec.structs.replace(msg, x=out)
            self.messages += 1
            link = self._links[("e2a", j, msg.worker)]
            await link.send(reply)
            self._note("link", link)

    def _expert_worker(self, expert: int) -> int:
        return expert * self.config.expert_workers // self.config.experts

    # -- attention: the token's path -------------------------------------------------------------
    def _admit(self, worker: int) -> _Sequence | None:
        if not self._admission:
            return None
        r = self._admission.pop(0)
        s = _Sequence(r, worker, self.prompts[r], self.config.layers)
        s.admitted_ns = now_ns()
        self._seqs[r] = s
        emit("dataflow", "admitted", request=r, worker=worker)
        return s

    def _layer_in(self, s: _Sequence, layer: int) -> list[_Message]:
        """Attention and gating of ``s``'s token at ``layer``: its k token copies."""
        m = self.model
        if layer == 0:
            s.x = m.embed[s.tokens[s.position]]
        s.history[layer].append(s.x)
        s.x = m.attend(s.x, s.history[layer])
        idx, w = m.moe[layer].route(s.x[None, :])
        self._layer[(s.request, layer)] = (idx[0], w[0])
        s.pending = {}
        return [
            _Message((s.request, s.position, layer, j, 0), s.worker, int(e), s.x)
            for j, e in enumerate(idx[0])
        ]

    def _layer_out(self, s: _Sequence, layer: int) -> None:
        idx, w = self._layer.pop((s.request, layer))
        s.x = self.model.combine(s.x, w, [s.pending[j] for j in range(len(idx))])

    def _advance(self, s: _Sequence) -> bool:
        """After the last layer: sample if this position produces a token; True if the
        sequence finished."""
        cfg = self.config
        if s.position >= cfg.prompt_tokens - 1:
            s.tokens.append(self.model.sample(s.x))
        s.position += 1
        if len(s.tokens) - cfg.prompt_tokens < cfg.output_tokens:
            return False
        self.results[s.request] = RequestResult(
            s.request, s.worker, s.tokens[cfg.prompt_tokens :], s.admitted_ns, now_ns()
        )
        del self._seqs[s.request]
        emit("dataflow", "finished", request=s.request, worker=s.worker)
        if len(self.results) == cfg.requests:
            self._done.set()
        return True

    async def _send_copies(self, msgs: list[_Message]) -> None:
        for msg in msgs:
            self.messages += 1
            link = self._links[("a2e", msg.worker, self._expert_worker(msg.expert))]
            await link.send(msg)  # blocks while the link is full: backpressure
            self._note("link", link)

    # -- attention: dataflow mode ------------------------------------------------------------------
    async def _attention_dataflow(self, i: int, work: MemoryObjectReceiveStream[_Sequence]) -> None:
        """One attention die: admit, then compute whichever token is ready next (its copies go
        out on their own task, so a blocked destination holds up only that token)."""
        cfg = self.config
        async with anyio.create_task_group() as tg:
            for _ in range(cfg.batch_per_worker):
                s = self._admit(i)
                if s is not None:
                    self._work[i].send_nowait(s)
            async for s in work:
                layer = s.ready_layer
                if layer == cfg.layers:  # all layers of this position done
                    if self._advance(s):
                        nxt = self._admit(i)
                        if nxt is not None:
                            self._work[i].send_nowait(nxt)
                        continue
                    layer = 0
                await sleep_ns(cfg.attention_ns + self._extra(f"attention:{i}"))
                tg.start_soon(self._send_copies, self._layer_in(s, layer))

    async def _receiver(self, i: int) -> None:
        """Results for worker ``i``'s tokens: applied at most once (by tag); a token whose k
        results are all in is combined and becomes ready for its next layer."""
        async for msg in self._attention_in[i][1]:
            request, pos, layer, slot, _epoch = msg.tag
            s = self._seqs.get(request)
            if (
                s is None
                or s.position != pos
                or (request, layer) not in self._layer
                or slot in s.pending
            ):
                self.duplicates_dropped += 1
                continue
            s.pending[slot] = msg.x
            if len(s.pending) == self.config.top_k:
                self._layer_out(s, layer)
                s.ready_layer = layer + 1
                self._work[i].send_nowait(s)

    # -- attention: sync mode ----------------------------------------------------------------------
    async def _attention_sync(self, i: int, barrier: Barrier) -> None:
        """One attention die in lockstep with the others: every layer of every token of its
        batch, then a barrier; admission at iteration boundaries."""
        cfg = self.config
        batch: list[_Sequence] = []
        inbox = self._attention_in[i][1]
        while True:
            while len(batch) < cfg.batch_per_worker and (s := self._admit(i)) is not None:
                batch.append(s)
            for layer in range(cfg.layers):
                copies: list[_Message] = []
                for s in batch:
                    await sleep_ns(cfg.attention_ns + self._extra(f"attention:{i}"))
                    copies.extend(self._layer_in(s, layer))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._send_copies, copies)
                    want = len(copies)
                    while want:
                        msg = await inbox.receive()
                        request, pos, lay, slot, _ = msg.tag
                        s = self._seqs.get(request)
                        if s is None or lay != layer or s.position != pos or slot in s.pending:
                            self.duplicates_dropped += 1
                            continue
                        s.pending[slot] = msg.x
                        want -= 1
                for s in batch:
                    self._layer_out(s, layer)
                await barrier.wait()  # the global step: nobody starts layer l + 1 early
            batch = [s for s in batch if not self._advance(s)]


document_fields(ComponentDelay, DataflowConfig, DataflowResult)
