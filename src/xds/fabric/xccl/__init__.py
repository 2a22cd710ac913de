"""XCCL: memory-semantic communication over the UB fabric (SPEC 3-5).

``XCCL`` is the library a serving engine calls: point-to-point ``send``/``receive`` (sync), their
async variants whose completions arrive on a per-die completion queue (an anyio object receive
stream), and the invariant monitor. Use it as an async context manager so async operations have
a task group to run in::

    async with XCCL(fabric) as xccl:
        await xccl.send(0, 17, AppBuffer(0, 4096), event_id=7, n_aiv=2)

Leaving the ``async with`` closes the communicator: completions already posted can still be read
(then each queue ends with ``anyio.EndOfStream``, as a memory object stream does once its
senders closed); sending, posting or entering again raises :class:`~xds.errors.XdsError`. A new
``XCCL(fabric)`` goes on: every communicator on a fabric shares the fabric's protocol state
(``fabric.p2p``: pairs, AIVs, monitor).
"""

from __future__ import annotations

from collections import deque
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from ...errors import ConfigError, ProtocolError, XdsError
from ...runtime import now_ns, waiting_for
from ...runtime.sync import leaf_exceptions
from ..ub import Engine, UBFabric
from .aiv import AivPool
from .monitor import P2PMonitor
from .p2p import P2P, AppBuffer, Message

__all__ = [
    "P2P",
    "XCCL",
    "AivPool",
    "AppBuffer",
    "Completion",
    "CompletionQueue",
    "Handle",
    "Message",
    "P2PMonitor",
]


class Completion(msgspec.Struct, frozen=True):
    """A completion-queue entry of an async operation."""

    op: Literal["send", "receive"]
    die: int
    peer: int
    event_id: int
    nbytes: int
    start_ns: int
    end_ns: int
    ok: bool
    error: str = ""


class CompletionQueue(anyio.abc.ObjectReceiveStream[Completion]):
    """The completion queue of one die: completions in the order they were posted.

    While the XCCL is open, :meth:`receive` waits for the next completion (``receive_nowait``
    raises ``anyio.WouldBlock`` if there is none yet). Once the XCCL has closed, the completions
    posted before are still delivered, in order, and then the queue ends: ``receive`` raises
    ``anyio.EndOfStream`` (saying so) and ``async for`` stops. Closing it (``aclose``) is the
    reader's choice: later reads raise ``anyio.ClosedResourceError`` and later completions of
    the die are dropped.
    """

    def __init__(self, die: int) -> None:
        self.die = die
        self._items: deque[Completion] = deque()
        self._posted = 0
        self._running = 0  # async operations of the die whose completion is still to come
        self._ended = False
        self._closed = False
        self._arrived: anyio.Event | None = None  # made by a waiting reader (needs a loop)

    def _post(self, completion: Completion) -> None:
        self._posted += 1
        if not self._closed:
            self._items.append(completion)
        self._wake()

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def receive_nowait(self) -> Completion:
        """The next completion, or ``anyio.WouldBlock`` (none yet) / ``anyio.EndOfStream``
        (the XCCL has closed and every completion posted to the queue has been received)."""
        if self._closed:
            raise anyio.ClosedResourceError(
                f"completion queue of die {self.die} was closed by its reader"
            )
        if self._items:
            return self._items.popleft()
        if self._ended:
            posted = (
                "no completion was posted to it"
                if not self._posted
                else f"{self._posted} completion{' was' if self._posted == 1 else 's were'} "
                "posted to it and all have been received"
            )
            raise anyio.EndOfStream(
                f"completion queue of die {self.die}: XCCL has closed; {posted}"
            )
        raise anyio.WouldBlock

    async def receive(self) -> Completion:
        await anyio.lowlevel.checkpoint()
        while True:
            try:
                return self.receive_nowait()
            except anyio.WouldBlock:
                pass
            if self._arrived is None:
                self._arrived = anyio.Event()
            with waiting_for(
                lambda: (
                    f"completion queue of die {self.die}: the next completion "
                    + (
                        f"({self._running} async operation(s) of die {self.die} still running)"
                        if self._running
                        else f"(no async operation of die {self.die} is running; has one been "
                        "posted?)"
                    )
                )
            ):
                await self._arrived.wait()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading: drop what is buffered; later reads raise ``ClosedResourceError``."""
        self._closed = True
        self._items.clear()
        self._wake()


class Handle:
    """An async operation in flight; ``await handle.wait()`` returns its completion."""

    def __init__(self, what: str = "an async XCCL operation") -> None:
        self.what = what
        """What the operation is, as error messages and deadlock reports name it."""
        self._done = anyio.Event()
        self._before: Handle | None = None
        """The operation posted on the pair before this one, until this one has its turn."""
        self._had_turn = False
        """Whether it waited out its turn (every operation posted before it on the pair had
        finished) before it ended; one cancelled while waiting did not."""
        self._scope: anyio.CancelScope | None = None
        self._cancel_requested = False
        self.completion: Completion | None = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Cancel the operation (no effect once it is done). It completes with ``ok=False``
        and ``error="cancelled"``, posted to its die's completion queue like any completion;
        :meth:`wait` raises :class:`~xds.errors.ProtocolError`. Cancelled before its message
        started, the pair is untouched; in the middle of a message it abandons the pair as a
        cancelled synchronous call does (the peer fails; ``XCCL.reset_pair`` recovers it)."""
        if self.done:
            return
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    async def wait(self) -> Completion:
        with waiting_for(f"{self.what} to complete"):
            await self._done.wait()
        if self.error is not None:
            raise self.error
        assert self.completion is not None
        return self.completion


def _leaves_of(exc: BaseException) -> list[int]:
    """Identities of the non-group exceptions in ``exc`` (itself if it is not a group)."""
    if isinstance(exc, BaseExceptionGroup):
        return [id(leaf) for leaf in leaf_exceptions(exc)]
    return [id(exc)]


class XCCL:
    """XCCL point-to-point over a fabric (collectives build on the same fabric).

    The protocol state is the fabric's (``fabric.p2p``: pair sequence numbers and ring slots,
    the dies' AIVs, the monitor), shared by every XCCL on the fabric, so communicators can
    follow one another (or run side by side) on the same pairs. ``protocol`` is that same
    object, or a variant built on the fabric before its first XCCL (``P2P`` subclasses).
    """

    def __init__(self, fabric: UBFabric, *, protocol: P2P | None = None):
        if not isinstance(fabric, UBFabric):
            raise ConfigError(f"must be a UBFabric, got {type(fabric).__name__}", field="fabric")
        if protocol is not None:
            if not isinstance(protocol, P2P):
                raise ConfigError(
                    f"must be a P2P (or None: the fabric's), got {type(protocol).__name__}",
                    field="protocol",
                )
            if protocol.fabric is not fabric:
                raise ConfigError(
                    "this P2P belongs to another fabric (omit protocol= to use this fabric's)",
                    field="protocol",
                )
        self.fabric = fabric
        self.p2p = protocol if protocol is not None else fabric.p2p
        self._tg: anyio.abc.TaskGroup | None = None
        self._state: Literal["new", "open", "closed"] = "new"
        self._cq: dict[int, CompletionQueue] = {}
        self._last_posted = self.p2p.last_posted
        """Per (op, die, peer): the latest operation posted, sync or async, by any XCCL on the
        fabric, which the next one waits for, so operations on a pair run in posting order on
        every backend (the fabric's P2P keeps it: two XCCLs side by side share the order)."""

    @property
    def monitor(self) -> P2PMonitor:
        return self.p2p.monitor

    async def __aenter__(self) -> XCCL:
        if self._state == "open":
            raise XdsError("this XCCL is already open: 'async with' it once, not nested")
        if self._state == "closed":
            raise XdsError(
                "XCCL has closed: an XCCL is entered once; open a new XCCL(xccl.fabric) to go "
                "on (it shares the fabric's pairs, AIVs and monitor)"
            )
        self.fabric._enter_run()  # a fabric used by an earlier run starts this one afresh
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg, self._state = tg, "open"
        return self

    def _check_open(self, call: str) -> None:
        if self._state == "closed":
            raise XdsError(
                f"XCCL has closed: {call} after 'async with XCCL(...)' exited; open a new "
                "XCCL(xccl.fabric) to go on (it shares the fabric's pairs, AIVs and monitor)"
            )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            if exc is not None and _leaves_of(group) == _leaves_of(exc):
                return False  # the body's own error propagates as raised, with its own
                # traceback (not wrapped again by XCCL's tasks, no frame of this exit)
            raise
        finally:
            self._tg, self._state = None, "closed"
            for queue in self._cq.values():
                queue._end()  # readers drain what was posted, then see the end

    # -- synchronous ---------------------------------------------------------------------------
    async def send(
        self,
        src: int,
        dst: int,
        buf: AppBuffer,
        event_id: int,
        *,
        n_aiv: int = 2,
        engine: Engine = "mte",
    ) -> int:
        """Send and return when the receiver has ACKed (AIVs held throughout).

        ``n_aiv`` AIVs move the chunks with MTE (``engine="mte"``); with ``engine="dma"``
        (NPU-Direct URMA) the AIVs only submit, and the chunks spread over ``min(n_aiv, the
        die's DMA engines)`` queues (4 on a 910C die), so more AIVs do not add bandwidth.
        It waits for the operations posted on the pair before it (async ones too)."""
        self._check_open("send()")
        return await self._in_order("send", src, dst, buf, event_id, n_aiv, engine)

    async def _in_order(
        self,
        op: Literal["send", "receive"],
        die: object,
        peer: object,
        buf: AppBuffer,
        event_id: object,
        n_aiv: object,
        engine: object,
        hold_aivs: bool = True,
    ) -> int:
        """A sync operation, posted now: it takes its turn on the pair after the operations
        posted before it, and the ones posted later wait for it."""
        fields = ("src", "dst") if op == "send" else ("dst", "src")
        die, peer, buf, event_id, n_aiv, engine = self.p2p._check(
            die, peer, buf, event_id, n_aiv, engine, fields=fields
        )
        start = now_ns()
        what = f"{op} of die {die} ({'to' if op == 'send' else 'from'} {peer}, eventID {event_id})"
        turn = Handle(what)
        key = (op, die, peer)
        self._post(key, turn)
        fn = self.p2p.send if op == "send" else self.p2p.receive
        try:
            await _wait_turn(what, turn)
            return await fn(
                die,
                peer,
                buf,
                event_id,
                n_aiv=n_aiv,
                engine=engine,
                hold_aivs=hold_aivs,
                posted_ns=start,
            )
        finally:
            turn._done.set()
            self._retire(key, turn)

    def _post(self, key: tuple[str, int, int], handle: Handle) -> None:
        """Post ``handle`` as the latest operation of ``key``, after the one before it."""
        handle._before = self._last_posted.get(key)
        self._last_posted[key] = handle

    def _retire(self, key: tuple[str, int, int], handle: Handle) -> None:
        """``handle`` ended: if it is still the latest operation of ``key``, the next one
        posted waits for what it waited for (nothing once it had its turn)."""
        if self._last_posted.get(key) is handle:
            if handle._before is None:
                del self._last_posted[key]
            else:  # cancelled while waiting its turn: the ones before it still run
                self._last_posted[key] = handle._before

    def reset_pair(self, src: int, dst: int) -> int:
        """Re-initialise a pair abandoned by a cancelled or timed-out transfer.

        Returns at once with the virtual time (ns) at which the pair is re-initialised: when
        the last write the abandoned transfer had posted has landed (``now_ns()`` if none is in
        flight). A ``send``/``receive`` on the pair waits until then, so it never sees a stale
        write. Only the direction ``src -> dst`` is reset. Raises ``ProtocolError`` if a send
        or receive on the pair is still running (a peer blocked on the abandoned message fails
        shortly after the cancel; reset after that).
        """
        return self.p2p.reset_pair(src, dst)

    def fail_die(self, die: int, *, detect_ns: int = 0) -> None:
        """Fail ``die`` now, fail-stop, on this fabric (every XCCL and collective group on it).

        The die issues nothing more (a chunk already being moved still lands): its own sends
        and receives raise :class:`~xds.errors.DieFailure` as soon as they next look. Each
        peer learns of it one metadata latency later plus ``detect_ns`` (model a heartbeat's
        detection time with it), and never before the writes already in flight on their pair
        have landed; from then on the peer's operations with the die (blocked or new) raise
        ``DieFailure``. A message that had fully arrived before the failure still completes.
        Collective groups with the die (dispatch/combine, A2E/E2A) break: each member's
        operation in flight raises ``DieFailure`` when its die learns of the failure (the
        failed die at once), later ones too (:mod:`xds.fabric.xccl.group_failure`). To fail a
        die at a later time, call this from a task that sleeps until then.
        """
        self.p2p.fail_die(die, detect_ns=detect_ns)

    def repair_die(self, die: int) -> int:
        """Bring a failed die back: every pair it belongs to is re-initialised (as
        :meth:`reset_pair`, both directions); returns the virtual time at which the last is
        ready (operations on them wait until then). Raises ``ProtocolError`` while an
        operation on one of its pairs is still running. Collective groups with the die stay
        broken (build new ones); their operations in flight fail as they would have."""
        return self.p2p.repair_die(die)

    def failed_dies(self) -> dict[int, int]:
        """Dies failed and not repaired, each with the virtual time (ns) it failed."""
        return self.p2p.failed_dies()

    async def receive(
        self,
        dst: int,
        src: int,
        buf: AppBuffer,
        event_id: int,
        *,
        n_aiv: int = 2,
        engine: Engine = "mte",
        hold_aivs: bool = True,
    ) -> int:
        """Receive the next message from ``src`` into ``buf``; return when copied and ACKed.
        It waits for the operations posted on the pair before it (async ones too).
        ``hold_aivs=False`` takes the AIVs only once the sender's message has arrived, as an
        async receive does (a receive holding them while it waits can deadlock transfers
        that wait for each other's dies' AIVs)."""
        self._check_open("receive()")
        if not isinstance(hold_aivs, bool):
            raise ConfigError(f"hold_aivs must be a bool, got {hold_aivs!r:.40}", field="hold_aivs")
        return await self._in_order(
            "receive", dst, src, buf, event_id, n_aiv, engine, hold_aivs=hold_aivs
        )

    # -- asynchronous --------------------------------------------------------------------------
    def completion_queue(self, die: int) -> CompletionQueue:
        """The completion queue of ``die``: async operations post their completions here.
        After the XCCL has closed it still delivers what was posted, then ends
        (``anyio.EndOfStream``)."""
        return self._queue(die)

    def _queue(self, die: int) -> CompletionQueue:
        if type(die) is not int:
            die = self.fabric.pod.check_die(die)
        q = self._cq.get(die)
        if q is None:
            self.fabric.pod.check_die(die)
            q = self._cq[die] = CompletionQueue(die)
            if self._state == "closed":
                q._end()  # nothing can be posted to it any more
        return q

    def send_async(
        self,
        src: int,
        dst: int,
        buf: AppBuffer,
        event_id: int,
        *,
        n_aiv: int = 2,
        engine: Engine = "mte",
    ) -> Handle:
        """Start a send; its AIVs are held while it moves data (including waits for ring
        credits) and released before it waits for the final ACK."""
        return self._start(
            "send", src, dst, buf, event_id, self.p2p.send, dict(n_aiv=n_aiv, engine=engine)
        )

    def receive_async(
        self,
        dst: int,
        src: int,
        buf: AppBuffer,
        event_id: int,
        *,
        n_aiv: int = 2,
        engine: Engine = "mte",
    ) -> Handle:
        """Start a receive; it takes its AIVs only once the sender's message has arrived, and
        its completion is posted to ``dst``'s completion queue."""
        return self._start(
            "receive", dst, src, buf, event_id, self.p2p.receive, dict(n_aiv=n_aiv, engine=engine)
        )

    def _start(
        self,
        op: Literal["send", "receive"],
        die: int,
        peer: int,
        buf: AppBuffer,
        event_id: int,
        fn: Any,
        kwargs: dict[str, Any],
    ) -> Handle:
        self._check_open(f"{op}_async()")
        if self._tg is None:
            raise XdsError(
                "async XCCL operations need a running XCCL: use 'async with XCCL(fabric) as xccl:'"
            )
        die, peer, buf, event_id, n_aiv, engine = self.p2p._check(
            die,
            peer,
            buf,
            event_id,
            kwargs["n_aiv"],
            kwargs["engine"],
            fields=("src", "dst") if op == "send" else ("dst", "src"),
        )
        kwargs = dict(n_aiv=n_aiv, engine=engine)
        what = (
            f"async {op} of die {die} ({'to' if op == 'send' else 'from'} {peer}, "
            f"eventID {event_id})"
        )
        handle = Handle(what)
        queue = self._queue(die)
        queue._running += 1
        key = (op, die, peer)
        self._post(key, handle)

        async def run() -> None:
            try:
                await operation()
            finally:
                queue._running -= 1

        async def operation() -> None:
            start = now_ns()
            ok, error = True, ""
            with anyio.CancelScope() as scope:
                handle._scope = scope
                if handle._cancel_requested:  # cancelled before it started
                    scope.cancel()
                try:
                    await _wait_turn(what, handle)
                    await fn(die, peer, buf, event_id, hold_aivs=False, posted_ns=start, **kwargs)
                except XdsError as exc:  # a protocol failure: reported, the run goes on
                    ok, error = False, str(exc)
                    handle.error = exc
                except anyio.get_cancelled_exc_class() as exc:
                    if not handle._cancel_requested:  # XCCL's exit tears it down
                        _complete_failed(handle, op, die, peer, event_id, buf, start, exc)
                    raise  # after Handle.cancel(), this scope catches it
                except BaseException as exc:  # a bug: still complete the handle
                    _complete_failed(handle, op, die, peer, event_id, buf, start, exc)
                    raise
            if scope.cancelled_caught:
                ok, error = False, "cancelled"
                handle.error = ProtocolError(f"{what} was cancelled")
            handle.completion = Completion(
                op, die, peer, event_id, buf.nbytes, start, now_ns(), ok, error
            )
            handle._done.set()
            self._retire(key, handle)
            queue._post(handle.completion)

        self._tg.start_soon(run, name=f"xccl-{op}-{die}-{peer}-{event_id}")
        return handle


async def _wait_turn(what: str, handle: Handle) -> None:
    """Wait until every operation posted on the pair before ``handle`` (``what``) is done.

    The one just before it may have ended (cancelled) while still waiting its own turn; then
    the ones before that one are waited for too, so a cancelled operation never lets a later
    one overtake an earlier one."""
    before = handle._before
    while before is not None:
        if not before.done:
            with waiting_for(
                f"{what}: {before.what} posted before it to finish (posting order on the pair)"
            ):
                await before._done.wait()
        if before._had_turn:
            break
        before = before._before
    handle._before = None  # the chain behind it is done: let it go
    handle._had_turn = True


def _complete_failed(
    handle: Handle,
    op: Literal["send", "receive"],
    die: int,
    peer: int,
    event_id: int,
    buf: AppBuffer,
    start: int,
    exc: BaseException,
) -> None:
    """Complete ``handle`` for an operation torn down by XCCL's exit or killed by a bug (no
    queue entry: XCCL is closing, and its queues end)."""
    handle.error = exc
    handle.completion = Completion(
        op, die, peer, event_id, buf.nbytes, start, now_ns(), False, f"{type(exc).__name__}: {exc}"
    )
    handle._done.set()
