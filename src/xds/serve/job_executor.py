"""The Job Executor's choices of Prefill TE and Decode TE (SPEC 10.2, P096, P099), pluggable.

For each request the Job Executor picks a Prefill TE by cache state, load and input length,
and, once the prompt is done, a Decode TE by load. Both choices are plain functions over what
the Job Executor sees of each TE; :class:`~xds.serve.replay.Replay` offers them only the TEs
that may serve the request (the long-input pool, when there is one, for inputs over its
threshold) and rejects an answer outside the offer with :class:`~xds.errors.ProtocolError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from ..docfields import document_fields
from ..trace.workload import Request
from .policies import ask, offered_choice


class PrefillTEView(msgspec.Struct, frozen=True):
    """What the Job Executor knows of one Prefill TE when a request arrives."""

    te: int
    predicted_first_token_ns: int
    """The TE's own estimate of the request's first token (running step, backlog, SP jobs)."""
    cached_tokens: int
    """The request's longest cached prefix on any of the TE's DP groups (at most input - 1)."""
    queued_tokens: int
    """Prompt tokens waiting or running on the TE."""
    last_picked: int
    """When the Job Executor last picked this TE (a counter; 0: never)."""


class DecodeTEView(msgspec.Struct, frozen=True):
    """What the Job Executor knows of one Decode TE when a prompt is done."""

    te: int
    sequences: int
    """Sequences routed to the TE (decoding, or routed and waiting for their KV)."""
    kv_used_blocks: int
    """KV blocks in use over the TE's DPs (as the DP groups last reported it)."""


PrefillTESelection = Callable[[Request, Sequence[PrefillTEView]], int]
"""(the request, the Prefill TEs that may serve it) -> the chosen view's ``te``."""

DecodeTESelection = Callable[[Request, Sequence[DecodeTEView]], int]
"""(the request, the Decode TEs in service whose DistFlow pair with its Prefill TE works) -> the
chosen view's ``te``."""


def earliest_first_token(request: Request, tes: Sequence[PrefillTEView]) -> int:
    """P096: the TE that promises the earliest first token for the request's uncached tokens
    (a TE busy with a long prompt loses short ones); ties go to the TE picked least recently,
    so an idle deployment spreads requests instead of piling them on TE 0."""
    return min(tes, key=lambda v: (v.predicted_first_token_ns, v.last_picked)).te


def fewest_sequences(request: Request, tes: Sequence[DecodeTEView]) -> int:
    """P099: the Decode TE with the fewest sequences routed to it (ties to the lowest index)."""
    return min(tes, key=lambda v: (v.sequences, v.te)).te


def checked_choice(
    policy: Callable[..., int],
    request: Request,
    offer: Sequence[PrefillTEView | DecodeTEView],
    field: str,
) -> int:
    """Ask ``policy`` (the ``field`` slot) and check its answer is one of the offered TEs (it
    sees them as a tuple of frozen views: nothing it does changes the offer)."""
    offered = [v.te for v in offer]
    answer = ask(policy, field, request.request_id, request, tuple(offer))
    return offered_choice(policy, answer, offered, "TE", request.request_id, field=field)


document_fields(PrefillTEView, DecodeTEView)
