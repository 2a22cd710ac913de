"""Prefill TEs: prefix cache and the single-level cooperative scheduler (SPEC 6.4).

A Prefill TE spans ``dies_per_te`` dies: attention runs with TP = ``attention_tp`` inside each
DP group (so ``dies_per_te / attention_tp`` DP groups) and the MoE layers run EP over all the
TE's dies (SPEC 12.4: DP8/EP32 on 32 dies). All requests sent to a TE sit in one pool; at each
step the leader (DP-0) looks at every DP group's state and assigns batches with a cost model
that counts prefix-cache hits (P058): a request goes to the DP group where it leaves the least
work this step, counting only its uncached tokens (so a cached prefix pulls it to the group
that holds it); ties go to the longer cached prefix, then to the group given a job least
recently (so a lightly loaded TE spreads its prompts, and its cache contents, over all its
groups). That rule is :func:`least_work`; ``PrefillTE(placement=...)`` (or ``replay(...,
prefill_placement=...)``) plugs in another over the same :class:`GroupView` of each group that
can take the job. DP groups run one step in lockstep (their
MoE layers exchange tokens), so every kernel of a step lasts as long as on its slowest group.
Each batched job runs on the one group it was assigned (SPEC 6.6). With ``balance_split``
(off by default: an experiment beyond the paper) the leader evens the step out instead: while
the slowest group's heaviest job can move a share of its work to a lighter group (one that
can hold the KV share within its token budget, a share of at least one KV block), it is
spread sequence-parallel over one more group, so a step with fewer jobs than groups can still
use every group; the plan is kept if the step cost model finds it faster.

**Step cost.** Eager mode (SPEC 2.1): the host dispatches each operator, the device runs it
when both it and its dispatch are ready (:meth:`~xds.serve.prefill_cost.PrefillCost.step_ns`,
in :mod:`xds.serve.prefill_cost`). Per layer, the
attention side of a DP group runs on ``tp`` dies, so its kernels take 1/tp of the single-die
time (prefill GEMMs are compute-bound); MLA attention is causal over cached + new tokens.
MoE: routed copies spread evenly over the EP dies (each holding ``experts / dies`` experts),
the shared expert on each die's share of its group's tokens; dispatch (INT8) and combine (BF16)
move each die's copies at the UB bandwidth derated by the all-to-all congestion factor of
:mod:`xds.hw`. Prefill also runs the MTP layer (P097). The step ends with the LM head on one
token per request, which emits the first output token.

**Sequence parallelism** (P029, P094). A request with more than ``sp_threshold`` uncached
tokens runs over all the TE's DP groups at once, alone in its step (P058: one set of SP ranks
should not serve short and long sequences together): each group projects and routes 1/sp of
its tokens and does 1/sp of its causal attention (a load-balanced split), while the latent KV
of the shares circulates in a ring over UB, overlapped with the attention compute. Each group
holds an equal share of its KV; the KV leaves for Decode through the leader group's ranks
(the decode die's single ingress link bounds that transfer either way).

**Prefix cache.** Per DP group, an LRU of prompt block hashes (Mooncake's ``hash_ids``, one per
``prefix_block_tokens`` tokens); a request reuses the longest cached run of its leading blocks.
A prompt's blocks are refreshed tail first, so its head (the shareable part) is evicted last.
A sequence-parallel prompt is cached by its leader group, the group given a job least recently.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Literal

import anyio
import msgspec
from msgspec import Meta

from ..config import check_fields
from ..docfields import document_fields
from ..errors import ConfigError
from ..model import KernelEfficiency, Precision
from ..runtime import emit, now_ns, sleep_ns
from .kv import KVBlockManager
from .policies import ask, offered_choice, require_callable
from .prefill_cost import Piece, PrefillCost, _tokens


class PrefillConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The Prefill TEs of a PD deployment (defaults: SPEC 12.4's 4 TEs of DP8/EP32)."""

    tes: Annotated[int, Meta(ge=1)] = 4
    dies_per_te: Annotated[int, Meta(ge=1)] = 32
    attention_tp: Annotated[int, Meta(ge=1)] = 4
    max_tokens_per_dp: Annotated[int, Meta(ge=1)] = 16_384
    """[emulator choice] new tokens one DP group takes in one step; a longer request runs alone."""
    prefix_block_tokens: Annotated[int, Meta(ge=1)] = 512
    """Tokens per prefix hash (Mooncake's ``hash_ids`` cover 512 tokens each)."""
    prefix_cache_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.5
    """[emulator choice] share of a DP group's KV blocks kept as prefix cache."""
    long_input_threshold: Annotated[int, Meta(ge=1)] = 32_768
    """Inputs longer than this go to the long-input pool (P119, P126)."""
    long_pool_tes: Annotated[int, Meta(ge=0)] = 0
    """The last ``long_pool_tes`` TEs serve only inputs over ``long_input_threshold``
    (P119, P126: dedicated resources for extreme requests). 0, the default: SPEC 12.4's four
    TEs all serve its 0-64K mix, the extreme requests P126 isolates being beyond it."""
    sp_threshold: Annotated[int, Meta(ge=0)] = 16_384
    """Requests with more uncached tokens than this run **sequence-parallel** over all the
    TE's DP groups, alone in their step (P029, P094; P058: one set of SP ranks should not mix
    short and long sequences). [emulator choice] the default equals ``max_tokens_per_dp``: a
    request too big for one group's step is spread over all of them. 0 turns this off (a long
    prompt is then batched; with ``balance_split`` on the leader may still spread it over idle
    groups)."""
    microbatches: Annotated[int, Meta(ge=1, le=2)] = 1
    """2: FlowServe's "Dynamic MicroBatching" (P052, not described further, A33) as two-batch
    overlap: the leader splits a step's new tokens into two causal halves whose MoE dispatch
    and combine run on the communication stream while the other half computes, whenever that
    is faster than one batch (small steps lose: twice the eager dispatches). [emulator choice]
    1 (off) by default: the paper does not say that prefill uses it, or how."""
    balance_split: bool = False
    """True: the leader evens out a batched step by spreading its heaviest jobs
    sequence-parallel over more DP groups (idle or lighter ones) while that shortens the
    step's slowest group (lockstep groups otherwise wait for the one with the long batch).
    [emulator choice] False (the default): every batched job stays on the one DP group the
    leader assigned it (SPEC 6.6); the paper's scheduler balances by assigning, and P058 names
    sequence parallelism among the costly alternatives it replaced. On, it is an experiment:
    at light load it more than halves TTFT (idle groups join a lone prompt), and it lets
    ``production-4p1d`` sustain 17 requests/s instead of 14.5 (the search of ``xds reproduce
    production`` with it on: mean TPOT 30.5 ms, TTFT 1,402 ms)."""
    hardware: Literal["910c", "910b"] = "910c"
    """910b: Prefill on attached scale-out servers; KV then moves over RoCE (P104)."""
    all_gather_ns: Annotated[int, Meta(ge=0)] = 5_000
    """The leader's all-gather of every DP group's state before it assigns a step (P058).
    [emulator choice] ~log2(8) UB round trips; it also lets every request that arrives at
    one instant join the same step."""
    block_tokens: Annotated[int, Meta(ge=1)] = 128
    precision: Precision = Precision()
    efficiency: KernelEfficiency = KernelEfficiency()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.dies_per_te % self.attention_tp:
            raise ConfigError(
                f"dies_per_te ({self.dies_per_te}) must be a multiple of attention_tp "
                f"({self.attention_tp})",
                field="prefill.dies_per_te",
            )
        if self.long_pool_tes >= self.tes and self.long_pool_tes:
            raise ConfigError(
                f"long_pool_tes ({self.long_pool_tes}) must leave at least one of the "
                f"{self.tes} TEs for ordinary inputs",
                field="prefill.long_pool_tes",
            )

    @property
    def dps_per_te(self) -> int:
        return self.dies_per_te // self.attention_tp


class PrefixCache:
    """LRU of prompt block hashes of one DP group."""

    def __init__(self, capacity_blocks: int):
        self.capacity = max(0, capacity_blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def hit_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` already cached."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Cache (or refresh) the prompt's blocks, evicting the least recently used. The blocks
        are touched last to first, so a prompt's tail leaves before its head: a leading run
        (the part another prompt can share) outlives the blocks behind it, as in vLLM, which
        frees a request's blocks in reverse order for the same reason."""
        if not self.capacity:
            return
        for h in reversed(hashes):
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


class PrefillJob(msgspec.Struct):
    """A request in a Prefill TE's pool and, once run, where and when."""

    request_id: int
    input_tokens: int
    prefix_hashes: tuple[int, ...]
    submitted_ns: int
    """When the request reached the deployment (its arrival): for placement policies that
    weigh a job's age; the scheduler itself orders by pool position."""
    dp: int = -1
    """The DP group that ran it (for a sequence-parallel job, the leader group that caches its
    prompt hashes)."""
    sp: int = 1
    """DP groups the job ran on: 1, all of the TE's for a long sequence-parallel prompt, or
    as many as the leader spread it over to balance a batched step."""
    alone: bool = False
    """Ran sequence-parallel alone in its step (over ``sp_threshold`` uncached tokens)."""
    cached_tokens: int = 0
    start_ns: int = -1
    first_token_ns: int = -1


class GroupView(msgspec.Struct, frozen=True):
    """What the leader knows of one DP group when it places a job (after its all-gather)."""

    dp: int
    step_tokens: int
    """New tokens already placed on the group in this step."""
    new_tokens: int
    """The job's tokens to compute if placed here (its input minus this group's cached prefix)."""
    cached_tokens: int
    """The job's prefix found in this group's cache, at most input - 1 (one token is always
    computed, to produce the first output token)."""
    kv_free_blocks: int
    """KV blocks free on the group before this job."""
    last_assigned: int
    """When the group was last given a job (a counter; 0: never)."""
    hit_tokens: int
    """The cached prefix before that cap (whole blocks: a group holding more of the prompt
    ranks higher even when both caps agree)."""


PrefillPlacement = Callable[[PrefillJob, Sequence[GroupView]], int]
"""A prefill placement policy (SPEC 6.6: the leader's pluggable cost model): the job (a copy)
and the DP groups that can take it this step (KV and token budget allow) -> the chosen group's
``dp``. It places batched jobs; a prompt over ``sp_threshold`` runs sequence-parallel on every
group (its leader, which caches its hashes, is the group given a job least recently), and
``balance_split`` may spread a placed job over more groups afterwards."""

Backlog = tuple[tuple[int, int], int, int]
"""(the batched prompt whose step alone is the longest, as (uncached, cached) tokens; the
batched uncached tokens; ns of sequence-parallel steps) of a pool."""


def least_work(job: PrefillJob, groups: Sequence[GroupView]) -> int:
    """P058's default: the group left with the least new work this step; ties go to the longer
    cached prefix, then to the group given a job least recently."""
    best = min(
        groups,
        key=lambda g: (g.step_tokens + g.new_tokens, -g.hit_tokens, g.last_assigned, g.dp),
    )
    return best.dp


class PrefillTE:
    """One Prefill TE: the shared request pool and the leader's cooperative scheduler."""

    def __init__(
        self,
        index: int,
        config: PrefillConfig,
        cost: PrefillCost,
        *,
        kv_blocks_per_dp: int,
        placement: PrefillPlacement = least_work,
    ):
        require_callable(placement, "prefill_placement", arity=2)
        self.placement = placement
        self.index = index
        self.config = config
        self.cost = cost
        cache_blocks = int(kv_blocks_per_dp * config.prefix_cache_fraction)
        kv_blocks = kv_blocks_per_dp - cache_blocks
        # the cache's share of KV, in prefix hashes (each covers prefix_block_tokens tokens)
        hashes = cache_blocks * config.block_tokens // config.prefix_block_tokens
        dps = config.dps_per_te
        self.kv = [KVBlockManager(kv_blocks, block_tokens=config.block_tokens) for _ in range(dps)]
        self.cache = [PrefixCache(hashes) for _ in range(dps)]
        self.pool: list[tuple[PrefillJob, anyio.Event]] = []
        self.queued_tokens = 0
        """Prompt tokens waiting or running: the load the Job Executor sees."""
        self._predicted: dict[tuple[int, int, bool], int] = {}
        """Step predictions per prompt size: the Job Executor's hot path skips building the
        step-cost memo's key (a tuple of every group's pieces)."""
        self._predicted_shares: dict[int, int] = {}
        """:meth:`_predicted_spread` per share, for the same reason."""
        self._backlog: Backlog = ((0, 0), 0, 0)
        """The pool as the first-token estimate reads it (:meth:`backlog_of`), counted afresh
        at every step and added to as jobs join."""
        self._uncached: dict[int, int] = {}
        """Per pending request, its uncached tokens as estimated when it joined the pool (its
        longest cached prefix on any group then)."""
        self._orphans: set[int] = set()
        """Requests cancelled during their step: their KV is freed when it ends."""
        self._wake = anyio.Event()
        self.steps = 0
        self.hung = False
        """A die failed (:meth:`hang`): no step completes any more."""
        self.busy_ns = 0
        self.sp_steps = 0
        self.sp_busy_ns = 0
        """Steps (and their time) that ran one long prompt sequence-parallel alone (over
        ``sp_threshold``); a batched step whose jobs the leader spread is not one of them."""
        self.group_busy_ns = 0
        """Over batched steps, step time x DP groups holding work (the rest of the groups sit
        the step out: lockstep)."""
        self.step_end_ns = 0
        """When the running step ends (in the past while idle)."""
        self._assigned = [0] * dps
        """When each DP group was last given a job (a counter): ties go to the group idle
        longest, so a lightly loaded TE spreads prompts - and its prefix caches - over all
        its groups instead of piling them on group 0."""
        self._assignments = 0

    def _note_assigned(self, dp: int) -> None:
        self._assignments += 1
        self._assigned[dp] = self._assignments

    def max_input_tokens(self) -> int:
        """The longest prompt this TE can prefill: one DP group's KV, or, when prompts may run
        sequence-parallel, an equal share on every group (a prompt too long for one group
        always runs so)."""
        one = self.kv[0].capacity * self.config.block_tokens
        return one * len(self.kv) if self._sp_possible() else one

    def cached_tokens(self, hashes: tuple[int, ...]) -> int:
        """Longest cached prefix of a prompt on any of this TE's DP groups (tokens)."""
        if not hashes:
            return 0
        return max(c.hit_blocks(hashes) for c in self.cache) * self.config.prefix_block_tokens

    def predicted_first_token_ns(
        self, new_tokens: int, now: int, input_tokens: int | None = None
    ) -> int:
        """The Job Executor's estimate of when a job with ``new_tokens`` uncached tokens (of
        ``input_tokens`` in all; default: none cached) would get its first token here: the
        running step's end, then as many steps as the pool's backlog fills, each as long as a
        step holding the pending prompt whose step alone is the longest (lockstep groups wait
        for their longest input, P096; each pending prompt counted at its uncached tokens when
        it joined, after its cached context) - spread over every group when the leader
        balances its steps (``balance_split``), but never shorter than the backlog's per-group
        share. A prompt that will run sequence-parallel
        (more uncached tokens than ``sp_threshold``, or more KV than one group holds, however
        much of it is cached) adds a step of its own instead."""
        longest, backlog, sp_ns = self._with(self._backlog, new_tokens, input_tokens)
        capacity = self.config.dps_per_te * self.config.max_tokens_per_dp
        steps = -(-backlog // capacity)
        if self.config.balance_split:  # the leader spreads a step's work over every group
            share = -(-min(backlog, capacity) // self.config.dps_per_te)
            step = max(self._predicted_step(*longest, sp=True), self._predicted_spread(share))
        else:
            step = self._predicted_step(*longest, sp=False)
        wait = steps * step if backlog else 0
        return max(now, self.step_end_ns) + wait + sp_ns

    def backlog_of(self, prompts: Iterable[tuple[int, int]]) -> Backlog:
        """Prompts of these sizes, each (uncached tokens, input tokens), as the first-token
        estimate reads them: (the one whose step alone is the longest among those that run
        batched, the uncached tokens that run batched, the steps of those that run
        sequence-parallel alone)."""
        backlog: Backlog = ((0, 0), 0, 0)
        for new, total in prompts:
            backlog = self._with(backlog, new, total)
        return backlog

    def _pending(self, jobs: Iterable[PrefillJob]) -> Backlog:
        """:meth:`backlog_of` the pending ``jobs``, each at the uncached tokens estimated when
        it joined the pool."""
        return self.backlog_of(
            (self._uncached.get(j.request_id, j.input_tokens), j.input_tokens) for j in jobs
        )

    def _with(self, backlog: Backlog, tokens: int, input_tokens: int | None = None) -> Backlog:
        """``backlog`` plus a prompt of ``tokens`` uncached tokens (``input_tokens`` in all;
        the cached rest is attention context its step still reads)."""
        longest, batched, sp_ns = backlog
        total = tokens if input_tokens is None else input_tokens
        cached = max(0, total - tokens)
        if self._is_sp(tokens, total):  # alone
            return longest, batched, sp_ns + self._predicted_step(tokens, cached, sp=True)
        if self._predicted_step(tokens, cached, sp=False) > self._predicted_step(
            *longest, sp=False
        ):
            longest = (tokens, cached)
        return longest, batched + tokens, sp_ns

    def _is_sp(self, new_tokens: int, input_tokens: int = 0) -> bool:
        """Whether a prompt runs sequence-parallel: more uncached tokens than ``sp_threshold``,
        or (``input_tokens``) more KV than one DP group holds."""
        if not self._sp_possible():
            return False
        too_long = input_tokens > self.kv[0].capacity * self.config.block_tokens
        return new_tokens > self.config.sp_threshold or too_long

    def _sp_possible(self) -> bool:
        return bool(self.config.sp_threshold) and self.config.dps_per_te > 1

    def _predicted_step(self, tokens: int, cached: int = 0, *, sp: bool) -> int:
        """A step of one prompt of ``tokens`` uncached tokens after ``cached`` cached ones,
        alone on a group or sequence-parallel over every group (both in 256-token steps, the
        cached ones rounded down; remembered per size; 0 for an empty prompt)."""
        if tokens <= 0:
            return 0
        tokens = -(-tokens // 256) * 256
        cached = cached // 256 * 256
        key = (tokens, cached, sp)
        hit = self._predicted.get(key)
        if hit is None:
            if len(self._predicted) >= 8_192:
                self._predicted.clear()
            hit = self._predicted[key] = self.cost.step_ns(
                self.cost.sp_step(tokens, cached) if sp else [[(tokens, cached)]]
            )
        return hit

    def _predicted_spread(self, share: int) -> int:
        """A step with ``share`` new tokens on every DP group (in 32-token steps)."""
        share = -(-share // 32) * 32
        hit = self._predicted_shares.get(share)
        if hit is None:
            if len(self._predicted_shares) >= 8_192:
                self._predicted_shares.clear()
            hit = self._predicted_shares[share] = self.cost.step_ns(
                [[(share, 0)] for _ in range(self.config.dps_per_te)]
            )
        return hit

    async def prefill(self, job: PrefillJob) -> PrefillJob:
        """Put ``job`` in the pool and wait until its prefill (first token) is done. Cancelled
        while waiting, the job leaves the pool; cancelled during its step, its KV is freed
        when the step ends (nobody is left to hand it on)."""
        done = anyio.Event()
        self.pool.append((job, done))
        new = max(1, job.input_tokens - self.cached_tokens(job.prefix_hashes))
        self._uncached[job.request_id] = new
        self._backlog = self._with(self._backlog, new, job.input_tokens)
        self.queued_tokens += job.input_tokens
        self._wake.set()
        try:
            await done.wait()
        except BaseException:
            self._abandon(job, done)
            raise
        return job

    def _abandon(self, job: PrefillJob, done: anyio.Event) -> None:
        if done.is_set():
            return  # prefilled: its owner releases the KV as for any request
        entry = (job, done)
        if entry in self.pool:  # still waiting: it leaves the pool
            self.pool.remove(entry)
            self.queued_tokens -= job.input_tokens
            self._uncached.pop(job.request_id, None)
            self._backlog = self._pending(j for j, _ in self.pool)
        else:  # in the running step: free its KV when the step ends
            self._orphans.add(job.request_id)

    def release(self, dp: int, request_id: int) -> None:
        """The DP dequeued the transfer's completion: free the request's KV blocks (its share
        on every DP group for a sequence-parallel request)."""
        self.kv[dp].release(request_id)
        for kv in self.kv:
            if kv.holds(request_id):
                kv.release(request_id)
        self._wake.set()

    def _assign(self) -> tuple[list[list[PrefillJob]], list[tuple[PrefillJob, anyio.Event]]]:
        """The leader's view of every DP group (KV free, tokens this step, cached prefixes)
        turned into this step's batches (per DP group) and the jobs placed; unplaceable jobs
        stay in the pool, in order."""
        cfg = self.config
        groups: list[list[PrefillJob]] = [[] for _ in self.kv]
        load = [0] * len(self.kv)
        keep: list[tuple[PrefillJob, anyio.Event]] = []
        placed: list[tuple[PrefillJob, anyio.Event]] = []
        sp_step = False
        for job, ev in self.pool:
            if sp_step:  # a sequence-parallel job has the whole step
                keep.append((job, ev))
                continue
            # each group's cached prefix of the prompt (tokens), and the longest (at most
            # input - 1)
            hits = [c.hit_blocks(job.prefix_hashes) * cfg.prefix_block_tokens for c in self.cache]
            hit = min(max(hits), job.input_tokens - 1)
            sp = self._is_sp(job.input_tokens - hit, job.input_tokens)
            views = []
            over = False  # a group could take it batched, but over sp_threshold uncached
            for dp, kv in enumerate(() if sp else self.kv):
                if not kv.can_admit(job.input_tokens):
                    continue
                hit_dp = hits[dp]
                cached = min(hit_dp, job.input_tokens - 1)
                new = max(1, job.input_tokens - cached)
                if load[dp] and load[dp] + new > cfg.max_tokens_per_dp:
                    continue
                if self._is_sp(new, job.input_tokens):  # batched here it would break the rule
                    over = True  # that such a prompt runs sequence-parallel
                    continue
                views.append(
                    GroupView(dp, load[dp], new, cached, kv.free, self._assigned[dp], hit_dp)
                )
            if not views and over:  # only groups without its cache can take it: SP, where
                sp = True  # the cached prefix counts (read over UB)
            if sp:
                if not placed and self._place_sp(job, hit, groups):
                    placed.append((job, ev))
                    sp_step = True
                elif not placed:  # first in line, but some group lacks KV for its share:
                    keep.append((job, ev))  # nothing behind it takes KV meanwhile (under
                    sp_step = True  # steady load it would never find every group free)
                else:
                    keep.append((job, ev))  # waits for a step it can have alone
                continue
            if not views:
                keep.append((job, ev))
                continue
            offered = [v.dp for v in views]
            if self.placement is least_work:
                answer: object = least_work(job, views)
            else:  # a copy of the job and frozen views: the policy cannot change either
                answer = ask(
                    self.placement,
                    "prefill_placement",
                    job.request_id,
                    job.__copy__(),
                    tuple(views),
                )
            best = offered_choice(
                self.placement,
                answer,
                offered,
                "prefill DP group",
                job.request_id,
                field="prefill_placement",
            )
            chosen = views[offered.index(best)]
            job.dp = best
            job.cached_tokens = chosen.cached_tokens
            self._note_assigned(best)
            self.kv[best].admit(job.request_id, job.input_tokens)
            load[best] += job.input_tokens - job.cached_tokens
            groups[best].append(job)
            placed.append((job, ev))
        self.pool = keep
        for job, _ in placed:
            self._uncached.pop(job.request_id, None)
        self._backlog = self._pending(j for j, _ in keep)
        if cfg.balance_split and placed and not sp_step:
            self._balance(groups)
        return groups, placed

    @staticmethod
    def _pieces(groups: list[list[PrefillJob]]) -> list[list[Piece]]:
        return [
            [(j.input_tokens - j.cached_tokens, j.cached_tokens, j.sp) for j in g] for g in groups
        ]

    def _balance(self, groups: list[list[PrefillJob]]) -> None:
        """Spread the heaviest job of the step's slowest group over one more DP group (the
        lightest that can hold its KV share) while that lowers the groups' loads (compared
        slowest first); each spread job's KV is re-admitted as equal shares on its groups.
        The loads are :meth:`PrefillCost.piece_work`; the spread plan is kept only if the
        step cost model also finds it faster than the plan it started from."""
        d, cfg = len(groups), self.config
        unsplit, before = [list(g) for g in groups], self._pieces(groups)
        jobs = {id(j): j for g in groups for j in g}
        work = {
            key: self.cost.piece_work(j.input_tokens - j.cached_tokens, j.cached_tokens)
            for key, j in jobs.items()
        }
        members = {key: [j.dp] for key, j in jobs.items()}
        load = [sum(work[id(j)] / j.sp for j in g) for g in groups]
        tokens = [sum(_tokens(p) for p in g) for g in before]  # new tokens per group
        while True:
            top = max(range(d), key=lambda g: (load[g], -g))
            job = max(groups[top], key=lambda j: (work[id(j)] / j.sp, -j.request_id))
            key, k = id(job), job.sp
            if k >= d:
                break
            share = -(-job.input_tokens // (k + 1))
            new = (job.input_tokens - job.cached_tokens) / (k + 1)
            if new < cfg.block_tokens:  # not worth a KV block on one more group
                break
            spare = [
                h
                for h in range(d)
                if h not in members[key]
                and self.kv[h].can_admit(share)
                and (not tokens[h] or tokens[h] + new <= cfg.max_tokens_per_dp)
            ]
            if not spare:
                break
            h = min(spare, key=lambda g: (load[g], self._assigned[g], g))
            after = list(load)
            for g in members[key]:
                after[g] -= work[key] / k - work[key] / (k + 1)
            after[h] += work[key] / (k + 1)
            if sorted(after, reverse=True) >= sorted(load, reverse=True):
                break
            load = after
            for g in members[key]:
                tokens[g] -= new * (k + 1) / k - new
            tokens[h] += new
            for g in members[key]:
                self.kv[g].release(job.request_id)
            members[key].append(h)
            for g in members[key]:
                self.kv[g].admit(job.request_id, share)
            job.sp = k + 1
            groups[h].append(job)
        spread = [j for j in jobs.values() if j.sp > 1]
        if not spread:
            return
        # the loads are a proxy: keep the spread plan only if the cost model agrees
        if self.cost.step_ns(self._pieces(groups)) < self.cost.step_ns(before):
            return
        for job in spread:  # back to one group each (every share out first: they used the
            for g in members[id(job)]:  # blocks the wholes had)
                self.kv[g].release(job.request_id)
        for job in spread:
            self.kv[job.dp].admit(job.request_id, job.input_tokens)
            job.sp = 1
        groups[:] = unsplit

    def _place_sp(self, job: PrefillJob, hit: int, groups: list[list[PrefillJob]]) -> bool:
        """Place ``job`` sequence-parallel on every DP group of an empty step if each can hold
        an equal share of its KV. ``hit``, the longest cached prefix on any group, counts (the
        SP ranks read it over UB)."""
        d = len(self.kv)
        share = -(-job.input_tokens // d)
        if not all(kv.can_admit(share) for kv in self.kv):
            return False
        for kv in self.kv:
            kv.admit(job.request_id, share)
        leader = min(range(d), key=self._assigned.__getitem__)  # caches the prompt's hashes
        self._note_assigned(leader)
        job.dp, job.sp, job.cached_tokens, job.alone = leader, d, hit, True
        for g in groups:
            g.append(job)
        return True

    def hang(self) -> None:
        """A die of this TE failed: the step in flight never completes, nor does any later one
        (the TE is taken down when the fault is detected)."""
        self.hung = True
        emit("prefill", "hang", te=self.index)
        self._wake.set()

    async def run(self) -> None:
        """The leader's loop: runs only while requests are pending (P058)."""
        while True:
            if self.hung:
                await anyio.sleep_forever()
            if self.pool:
                await sleep_ns(self.config.all_gather_ns)  # the leader gathers DP state
            groups, placed = self._assign() if self.pool else ([], [])
            if not placed:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            start = now_ns()
            for job, _ in placed:
                job.start_ns = start
            step = self.cost.step_ns(self._pieces(groups))
            self.step_end_ns = start + step
            await sleep_ns(step)
            if self.hung:
                continue
            self.steps += 1
            self.busy_ns += step
            if placed[0][0].alone:
                self.sp_steps += 1
                self.sp_busy_ns += step
            else:
                self.group_busy_ns += step * sum(1 for g in groups if g)
            t = now_ns()
            for job, ev in placed:
                job.first_token_ns = t
                # only whole blocks: a hash over a prompt's partial last block holds fewer
                # tokens than a later prompt's full block with that hash would reuse
                whole = job.input_tokens // self.config.prefix_block_tokens
                self.cache[job.dp].insert(job.prefix_hashes[:whole])
                self.queued_tokens -= job.input_tokens
                emit("prefill", "done", te=self.index, dp=job.dp, request=job.request_id)
                ev.set()
                if job.request_id in self._orphans:  # its request was cancelled meanwhile
                    self._orphans.discard(job.request_id)
                    self.release(job.dp, job.request_id)

    def check(self) -> None:
        for kv in self.kv:
            kv.check()


document_fields(PrefillConfig, GroupView)
