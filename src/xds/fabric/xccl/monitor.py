"""Protocol invariants of XCCL point-to-point, checked as the protocol runs (SPEC 3.4, 3.7).

The monitor watches every ring slot of every pair:

* **R1 data before tailPtr**: when a tailPtr becomes visible, every byte it covers must
  already be visible in the receiver's ring.
* **R2 no reuse before ACK**: a slot is never written while it holds a chunk that has not been
  fully copied out; a chunk being copied out is never overwritten.
* A receiver never reads a slot that does not hold the chunk it expects.

Violations are recorded (``violations``) and, when checked from a task, raised as
:class:`xds.errors.ProtocolError`.
"""

from __future__ import annotations

from ...errors import ProtocolError

_FILLED = "filled"
_READING = "reading"


class P2PMonitor:
    def __init__(self) -> None:
        self.violations: list[str] = []
        self._slots: dict[tuple[int, int, int], tuple[str, int]] = {}
        self._visible: dict[tuple[int, int, int], int] = {}
        self.max_occupied: dict[tuple[int, int], int] = {}
        self._occupied: dict[tuple[int, int], int] = {}

    def _violate(self, text: str) -> None:
        self.violations.append(text)

    def data_visible(
        self, src: int, dst: int, lane: int, slot: int, chunk: int, nbytes: int
    ) -> None:
        key = (src, dst, slot)
        held = self._slots.get(key)
        if held is not None:
            self._violate(
                f"R2: pair {src}->{dst} slot {slot} overwritten by chunk {chunk} while chunk "
                f"{held[1]} was {held[0]} (not yet consumed)"
            )
        self._slots[key] = (_FILLED, chunk)
        lane_key = (src, dst, lane)
        self._visible[lane_key] = self._visible.get(lane_key, 0) + nbytes
        pair = (src, dst)
        self._occupied[pair] = self._occupied.get(pair, 0) + 1
        self.max_occupied[pair] = max(self.max_occupied.get(pair, 0), self._occupied[pair])

    def tail_visible(self, src: int, dst: int, lane: int, tail_ptr: int) -> None:
        visible = self._visible.get((src, dst, lane), 0)
        if tail_ptr > visible:
            self._violate(
                f"R1: pair {src}->{dst} lane {lane} tailPtr {tail_ptr} visible before its data "
                f"(only {visible} bytes visible)"
            )

    def read_start(self, src: int, dst: int, slot: int, chunk: int) -> None:
        self.check()  # surface violations recorded in write callbacks
        held = self._slots.get((src, dst, slot))
        if held != (_FILLED, chunk):
            self._raise(
                f"pair {src}->{dst}: receiver reads chunk {chunk} from slot {slot} which holds "
                f"{held[0] + ' chunk ' + str(held[1]) if held else 'nothing'}"
            )
        self._slots[(src, dst, slot)] = (_READING, chunk)

    def read_end(self, src: int, dst: int, slot: int, chunk: int) -> None:
        held = self._slots.get((src, dst, slot))
        if held != (_READING, chunk):
            self._raise(
                f"R2: pair {src}->{dst} slot {slot} was overwritten while chunk {chunk} was being "
                "copied out"
            )
        del self._slots[(src, dst, slot)]
        self._occupied[(src, dst)] -= 1

    def forget_pair(self, src: int, dst: int) -> None:
        """Drop the state of one pair (after :meth:`P2P.reset_pair`)."""
        for table in (self._slots, self._visible):
            for key in [k for k in table if k[0] == src and k[1] == dst]:
                del table[key]
        self._occupied.pop((src, dst), None)

    def check(self) -> None:
        """Raise if any violation was recorded."""
        if self.violations:
            raise ProtocolError("; ".join(self.violations[:5]))

    def _raise(self, text: str) -> None:
        self._violate(text)
        raise ProtocolError(text)
