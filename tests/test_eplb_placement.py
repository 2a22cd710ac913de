"""EPLB replica selection and placement on layouts where several experts share a primary die.

A redundant slot can hold any expert except one its die already holds, so on such layouts not
every slot can take every expert: selection must choose only replicas that some placement can
hold, and placement must find that placement (moving earlier replicas when the greedy choice
boxed a later one in).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from xds.errors import ConfigError
from xds.serve.eplb import DeepSeekEPLB, Layout, XdsGreedy, checked_plan, policy
from xds.serve.eplb.policies import _place

BUILT_IN = ["xds-greedy", "deepseek-eplb"]


def placeable(layout: Layout) -> int:
    """Most redundant replicas the layout can hold: die ``d`` takes at most ``spare_slots``,
    one per expert whose primary is elsewhere (an oracle independent of the policies)."""
    primary = np.asarray(layout.primary_die)
    return sum(min(layout.spare_slots, int((primary != d).sum())) for d in range(layout.n_dies))


def assert_valid(plan, layout: Layout, budget: int, name: str) -> int:
    """The plan keeps primaries, never puts two copies of an expert on a die, never fills a
    die beyond its redundant slots nor goes over the budget; returns the replicas it adds."""
    used = np.zeros(layout.n_dies, int)
    for e, dies in enumerate(plan.replica_dies):
        assert dies[0] == layout.primary_die[e]
        assert len(dies) == plan.copies[e] == len(set(dies))
        for d in dies[1:]:
            used[d] += 1
    assert (used <= layout.spare_slots).all()
    extra = int(plan.copies.sum()) - len(plan.copies)
    assert extra <= budget
    checked_plan(plan, policy=name, layer=0, layout=layout, budget=budget)
    return extra


@pytest.mark.parametrize("name", BUILT_IN)
def test_hot_experts_sharing_a_die_leave_the_other_slot_to_an_expert_that_fits(name):
    """Experts 0 and 1 (the hot ones) live on die 0, expert 2 on die 1; one slot per die.
    Both hot experts can only use die 1's slot; die 0's slot can only hold expert 2. This
    used to fail with "no free redundant slot" although two replicas fit."""
    counts = np.array([[100.0, 90.0], [80.0, 95.0], [5.0, 4.0]])
    layout = Layout(np.array([0, 0, 1]), n_dies=2, spare_slots=1)
    plan = policy(name).plan(counts, layout, 2)
    assert_valid(plan, layout, 2, name)
    assert plan.replica_dies[0] == [0, 1]  # the hottest expert gets die 1's slot
    assert plan.replica_dies[1] == [0]  # nowhere left for the second hot expert
    if name == "deepseek-eplb":  # it considers every expert: die 0's slot goes to expert 2
        assert plan.replica_dies[2] == [1, 0]


@pytest.mark.parametrize("name", BUILT_IN)
def test_all_experts_on_one_die_use_only_the_other_dies_slots(name):
    counts = np.arange(1.0, 9.0)[:, None] * np.ones((8, 3))
    layout = Layout(np.zeros(8, np.int64), n_dies=3, spare_slots=2)
    plan = policy(name).plan(counts, layout, 6)
    extra = assert_valid(plan, layout, 6, name)
    assert extra == placeable(layout) == 4  # die 0's two slots cannot hold any of them
    assert all(0 not in dies[1:] for dies in plan.replica_dies)


def test_placement_moves_a_chain_of_replicas_to_make_room():
    """Every slot of a 3-die, 2-slot layout is used and only one placement exists. Largest
    first boxes expert 2's last replica in: its only die (2) is full, and the replica there
    that could leave (expert 1's) can only go to die 0, which is full too. Making room takes
    two moves (expert 3 from die 0 to die 1's free slot, then expert 1 from die 2 to die 0);
    placement used to try only one and fail."""
    layout = Layout(np.array([0, 1, 1, 2]), n_dies=3, spare_slots=2)
    copies = np.array([3, 2, 3, 2])
    load = np.array([49.0, 61.0, 18.0, 96.0])
    plan = _place([3, 1, 0, 0, 2, 2], copies, load, layout)
    assert assert_valid(plan, layout, 6, "placement") == 6
    assert [sorted(d[1:]) for d in plan.replica_dies] == [[1, 2], [0], [0, 2], [1]]


@st.composite
def layouts(draw):
    n_dies = draw(st.integers(1, 7))
    n_experts = draw(st.integers(1, 12))
    primary = draw(st.lists(st.integers(0, n_dies - 1), min_size=n_experts, max_size=n_experts))
    spare = draw(st.integers(0, 3))
    return Layout(np.array(primary, np.int64), n_dies=n_dies, spare_slots=spare)


@given(
    layout=layouts(),
    seed=st.integers(0, 2**16),
    slices=st.integers(1, 4),
    extra_budget=st.integers(-3, 3),
    name=st.sampled_from(BUILT_IN),
)
# found by the property: the two hottest experts share die 0, the only slot they can use is
# die 1's (both policies used to fail)
@example(
    layout=Layout(np.array([0, 1, 0, 0, 1, 0, 0, 0, 0, 0]), n_dies=2, spare_slots=1),
    seed=0,
    slices=2,
    extra_budget=2,
    name="deepseek-eplb",
)
@example(
    layout=Layout(np.array([1, 3, 1, 2, 1]), n_dies=4, spare_slots=2),
    seed=2,
    slices=3,
    extra_budget=2,
    name="xds-greedy",
)
def test_policies_fill_random_shared_layouts_without_failing(
    layout, seed, slices, extra_budget, name
):
    """Random valid layouts (experts sharing primary dies, 0-3 spare slots), budgets around
    the slot count: the built-ins never fail, keep every rule, and ``deepseek-eplb`` (which
    may give a replica to any expert) adds exactly min(budget, replicas the layout can hold)."""
    rng = np.random.default_rng(seed)
    n_e = len(layout.primary_die)
    counts = rng.lognormal(0, 1.5, (n_e, slices)).round() + 1
    budget = max(0, layout.n_dies * layout.spare_slots + extra_budget)
    plan = policy(name).plan(counts, layout, budget)
    extra = assert_valid(plan, layout, budget, name)
    room = placeable(layout)
    assert extra <= min(budget, room)
    if name == "deepseek-eplb":
        assert extra == min(budget, room)


@given(layout=layouts(), seed=st.integers(0, 2**16))
def test_xds_greedy_stops_only_when_no_hottest_expert_can_take_a_replica(layout, seed):
    """Short of the budget, every expert that is the hottest (per replica) of some slice
    has no die left that could hold one more replica of it."""
    rng = np.random.default_rng(seed)
    counts = rng.lognormal(0, 1.5, (len(layout.primary_die), 3)).round() + 1
    budget = layout.n_dies * layout.spare_slots
    plan = XdsGreedy().plan(counts, layout, budget)
    extra = assert_valid(plan, layout, budget, "xds-greedy")
    if extra == budget:
        return
    per = counts / plan.copies[:, None]
    hottest = {int(e) for e in np.nonzero(per == per.max(axis=0))[0]}
    for e in sorted(hottest):
        more = plan.copies.copy()
        more[e] += 1
        with pytest.raises(ConfigError, match="no die"):
            _place(
                [f for f in range(len(more)) for _ in range(more[f] - 1)],
                more,
                counts.sum(axis=1),
                layout,
            )


def test_an_infeasible_copies_vector_is_a_clear_error_naming_the_expert():
    layout = Layout(np.array([0, 0]), n_dies=2, spare_slots=1)
    with pytest.raises(ConfigError, match=r"expert 1.*no die"):
        _place([0, 1], np.array([2, 2]), np.array([5.0, 4.0]), layout)


def test_deepseek_eplb_gives_die_slots_to_experts_that_can_use_them():
    """Ten experts, eight on die 0: die 0's slot can only hold one of the two on die 1."""
    primary = np.array([0, 1, 0, 0, 1, 0, 0, 0, 0, 0])
    layout = Layout(primary, n_dies=2, spare_slots=1)
    counts = np.array([[90.0], [3.0], [80.0], [70.0], [2.0], [1], [1], [1], [1], [1]])
    plan = DeepSeekEPLB().plan(counts, layout, 4)
    assert plan.replica_dies[0] == [0, 1] and plan.replica_dies[1] == [1, 0]
    assert int(plan.copies.sum()) - 10 == 2


def test_a_layout_without_experts_is_a_config_error():
    """The policies used to fail on it with numpy's "zero-size array" error."""
    with pytest.raises(ConfigError, match=r"primary_die: .*\(at least one expert\)"):
        Layout(np.array([], np.int64), n_dies=3, spare_slots=1)
