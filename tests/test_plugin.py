"""The pytest plugin (`@pytest.mark.xds`, `xds_backend`): what it runs and how it reports misuse.

Each test writes a small test file and runs pytest on it in-process (``pytester``); the plugin is
loaded there through its ``pytest11`` entry point, as for any user.
"""

from __future__ import annotations

import pytest

from xds.testing.plugin import MARKER_KEYWORDS

pytest_plugins = ["pytester"]

HEADER = "import pytest, xds\n\n"


def run(pytester: pytest.Pytester, body: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(HEADER + body)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rA", *args)


def test_marker_keywords_are_the_runtimes():
    assert MARKER_KEYWORDS == (
        "seed",
        "backend",
        "event_log",
        "schedule_seed",
        "livelock_limit",
        "time_limit_ns",
        "time_step_limit",
    )


def test_marked_async_tests_run_in_virtual_time_with_the_markers_seed(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds(seed=7)
async def test_seed():
    await xds.sleep_ns(3_600 * 10**9)
    assert xds.now_ns() == 3_600 * 10**9
    assert xds.current_runtime().seed == 7
    assert xds.current_runtime().backend == "asyncio"

@pytest.mark.xds(backend="trio", event_log=False)
async def test_trio():
    assert xds.current_runtime().backend == "trio"

class TestClass:
    @pytest.mark.xds(seed=3)
    async def test_method(self):
        assert xds.current_runtime().seed == 3

@pytest.mark.xds
@pytest.mark.parametrize("n", [1, 2])
async def test_param(n):
    await xds.sleep_ns(n)
    assert xds.now_ns() == n
""",
    )
    result.assert_outcomes(passed=5)


def test_xds_backend_fixture_runs_a_test_on_each_backend(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds
async def test_both(xds_backend):
    assert xds.current_runtime().backend == xds_backend
""",
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["PASSED *test_both[[]asyncio[]]", "PASSED *test_both[[]trio[]]"])


def test_markers_backend_restricts_the_xds_backend_parametrisation(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds(seed=7, backend="trio")
async def test_trio_only(xds_backend):
    assert xds_backend == "trio"
    assert xds.current_runtime().backend == "trio"

@pytest.mark.xds
@pytest.mark.parametrize("xds_backend", ["trio"])
async def test_own_parametrize_wins(xds_backend):
    assert xds.current_runtime().backend == "trio"
""",
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["PASSED *test_trio_only[[]trio[]]", "PASSED *test_own_parametrize_wins[[]trio[]]"]
    )
    result.stdout.no_fnmatch_line("*asyncio*")


def test_positional_argument_is_an_error_naming_the_keyword(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds(7)
async def test_positional():
    pass
""",
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["@pytest.mark.xds takes keywords only, got positional 7; write @pytest.mark.xds(seed=7)"]
    )


def test_unknown_keyword_is_an_error_listing_the_accepted_ones(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds(sede=1)
async def test_typo():
    pass
""",
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.xds got an unknown keyword 'sede' (did you mean 'seed'?); "
            f"it accepts {', '.join(MARKER_KEYWORDS)}"
        ]
    )
    result.stdout.no_fnmatch_line("*TypeError*")


def test_unknown_backend_is_an_error(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds(backend="curio")
async def test_curio():
    pass
""",
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["@pytest.mark.xds got an unknown backend 'curio'; choose one of asyncio, trio"]
    )


def test_an_xds_test_that_also_uses_anyios_plugin_is_an_error_not_a_wall_clock_run(pytester):
    result = run(
        pytester,
        """
import anyio

pytestmark = pytest.mark.anyio  # e.g. set for a whole module of anyio tests

@pytest.mark.xds
async def test_both_markers():
    await anyio.sleep(3600)  # would take an hour of wall time on anyio's own loop

@pytest.mark.xds
async def test_fixture(anyio_backend):
    await anyio.sleep(3600)
""",
    )
    result.assert_outcomes(errors=4)  # each test on each of anyio's backends
    result.stdout.fnmatch_lines(
        ["*@pytest.mark.xds this test also uses anyio's pytest plugin (@pytest.mark.anyio or *"]
    )


def test_marker_on_a_plain_test_is_an_error(pytester):
    result = run(
        pytester,
        """
@pytest.fixture
def side_effect():
    raise AssertionError("fixtures must not run for a misused marker")

@pytest.mark.xds
def test_sync(side_effect):
    pass
""",
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["@pytest.mark.xds needs an `async def` test, but this is a *"])
    result.stdout.no_fnmatch_line("*must not run*")


def test_marker_inherited_from_module_or_class_leaves_plain_tests_alone(pytester):
    result = run(
        pytester,
        """
pytestmark = pytest.mark.xds(seed=5)

def test_plain_module():
    pass

async def test_async_module():
    assert xds.current_runtime().seed == 5

@pytest.mark.xds(seed=6)
class TestClass:
    def test_plain_method(self):
        pass

    async def test_async_method(self):
        assert xds.current_runtime().seed == 6
""",
    )
    result.assert_outcomes(passed=4)


def test_module_marker_is_still_checked(pytester):
    result = run(
        pytester,
        """
pytestmark = pytest.mark.xds(seeed=1)

async def test_one():
    pass
""",
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*unknown keyword 'seeed' (did you mean 'seed'?)*"])


def test_async_fixtures_are_an_error(pytester):
    result = run(
        pytester,
        """
@pytest.fixture
async def async_fix():
    return 1

@pytest.fixture
async def async_gen_fix():
    yield 1

@pytest.fixture
def sync_on_async(async_gen_fix):
    return async_gen_fix

@pytest.mark.xds
async def test_direct(async_fix):
    pass

@pytest.mark.xds
async def test_transitive(sync_on_async):
    pass
""",
    )
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.xds does not support async fixtures, and 'async_fix' is one; *",
            "@pytest.mark.xds does not support async fixtures, and 'async_gen_fix' is one; *",
        ]
    )


def test_a_returned_value_warns_like_pytest(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds
async def test_returns():
    return 5
""",
    )
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*PytestReturnNotNoneWarning*"])


def test_a_model_deadlock_fails_the_test_with_its_diagnosis(pytester):
    result = run(
        pytester,
        """
import anyio

@pytest.mark.xds
async def test_deadlock():
    await anyio.Event().wait()
""",
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ModelDeadlock: model deadlock at t=0 ns*"])


def test_a_methods_marker_adds_to_its_classs(pytester):
    """Each keyword comes from the closest marker that sets it: a method's time limit keeps
    its class's seed."""
    result = run(
        pytester,
        """
@pytest.mark.xds(seed=3)
class TestMerge:
    @pytest.mark.xds(time_limit_ns=10**9)
    async def test_merge(self):
        assert xds.current_runtime().seed == 3
        assert xds.current_runtime().time_limit_ns == 10**9

@pytest.mark.xds(seed=1, livelock_limit=500)
class TestBase:
    pass

@pytest.mark.xds(seed=2)
class TestChild(TestBase):
    async def test_subclass_wins(self):
        assert xds.current_runtime().seed == 2
        assert xds.current_runtime().livelock_limit == 500
""",
    )
    result.assert_outcomes(passed=2)


def test_bad_marker_values_are_one_line_setup_errors(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds(seed=-1)
async def test_negative_seed():
    pass

@pytest.mark.xds(time_limit_ns=1.5)
async def test_float_limit():
    pass
""",
    )
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.xds got a bad value: seed: seed must be a non-negative integer*",
            "@pytest.mark.xds got a bad value: time_limit_ns: *1.5",
        ]
    )
    assert "Traceback" not in result.stdout.str()


def test_a_time_step_limit_in_the_marker_stops_a_poll_on_both_backends(pytester):
    """A time-step limit in the marker ends a fine-grained poll loop (days of wall time before
    the one-day virtual limit) on each backend, with the time limit's report."""
    result = run(
        pytester,
        """
import anyio

@pytest.mark.xds(time_step_limit=20_000)
async def test_poll(xds_backend):
    ready = anyio.Event()

    async def poll():
        while not ready.is_set():  # nobody ever sets it
            await xds.sleep_ns(1_000)

    async with anyio.create_task_group() as tg:
        tg.start_soon(poll, name="poller")
        await ready.wait()
""",
    )
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*ModelTimeStepLimit: time-step limit of 20000 reached at t=20000000 ns*",
            "*poller: test_a_time_step_limit_in_the_marker_stops_a_poll_on_both_backends.py:*",
        ]
    )
    assert "asyncio" in result.stdout.str() and "trio" in result.stdout.str()


@pytest.mark.slow
def test_the_markers_default_time_step_limit_stops_a_microsecond_poll(pytester):
    """The default itself (a million steps), end to end, on the reference backend: a 1 us poll
    would take days of wall time to reach the default one-day limit."""
    result = run(
        pytester,
        """
import anyio

@pytest.mark.xds
async def test_poll():
    assert xds.current_runtime().time_step_limit == 1_000_000
    assert xds.current_runtime().time_limit_ns == 86_400 * 10**9

    async def poll():
        while True:
            await xds.sleep_ns(1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(poll, name="poller")
""",
        "--durations=1",
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*time-step limit of 1000000 reached at t=1000000 ns*"])


def test_a_marked_test_within_its_time_step_limit_passes_and_none_lifts_it(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds(time_step_limit=100)
async def test_exactly_at_the_limit(xds_backend):
    for _ in range(100):
        await xds.sleep_ns(7)
    assert xds.now_ns() == 700 and xds.current_runtime().time_steps == 100

@pytest.mark.xds(time_step_limit=None)
async def test_lifted():
    assert xds.current_runtime().time_step_limit is None

@pytest.mark.xds(time_step_limit=0)
async def test_zero():
    pass
""",
    )
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*@pytest.mark.xds got a bad value: time_step_limit: time_step_limit must be a positive*"]
    )


LIBRARY_TEXT = (
    "Run the given coroutine function",  # anyio.run's docstring
    "anyio/_core/_eventloop.py",
    "anyio/_backends",
    "asyncio/runners.py",
    "xds/runtime/core.py",
    "async def _root",
)


def _failure_section(result: pytest.RunResult, name: str) -> str:
    """The text of ``name``'s entry in the FAILURES section."""
    text = result.stdout.str()
    start = text.index(f" {name} ")
    ends = [text.find(mark, start + 1) for mark in ("\n___", "\n===")]
    return text[start : min(e for e in ends if e != -1)]


def test_a_model_failure_report_is_not_buried_in_library_frames(pytester):
    result = run(
        pytester,
        """
import anyio

@pytest.mark.xds
async def test_deadlock(xds_backend):
    await anyio.Event().wait()

@pytest.mark.xds(time_step_limit=100)
async def test_poll():
    while True:
        await xds.sleep_ns(5)

@pytest.mark.xds(livelock_limit=1000)
async def test_spin():
    while True:
        await anyio.lowlevel.checkpoint()

@pytest.mark.xds
async def test_cleanup_raises(xds_backend):
    try:
        await anyio.Event().wait()
    finally:
        raise RuntimeError("cleanup failed")
""",
    )
    result.assert_outcomes(failed=6)
    for name, report in (
        ("test_deadlock[asyncio]", "ModelDeadlock: model deadlock at t=0 ns"),
        ("test_deadlock[trio]", "ModelDeadlock: model deadlock at t=0 ns"),
        ("test_poll", "ModelTimeStepLimit: time-step limit of 100 reached at t=500 ns"),
        ("test_spin", "ModelLivelock: model livelock at t=0 ns: 1000 loop iterations"),
    ):
        section = _failure_section(result, name)
        assert report in section, section
        assert "- main: test_a_model_failure_report_is_not_buried_in_library_frames.py:" in section
        for text in LIBRARY_TEXT:
            assert text not in section, (text, section)
        assert len(section.splitlines()) <= 8, section
    for backend in ("asyncio", "trio"):
        # an error while the model unwinds is the report's cause, shown from the user's line;
        # the cancellation the runtime delivered to stop the model is left out
        section = _failure_section(result, f"test_cleanup_raises[{backend}]")
        assert '>           raise RuntimeError("cleanup failed")' in section
        assert "The above exception was the direct cause" in section
        assert "ModelDeadlock: model deadlock at t=0 ns" in section
        assert "Cancel" not in section and "During handling" not in section, section
        for text in LIBRARY_TEXT:
            assert text not in section, (text, section)


def test_a_failed_assertion_in_a_marked_test_still_shows_the_users_line(pytester):
    result = run(
        pytester,
        """
import anyio

@pytest.mark.xds
async def test_assert(xds_backend):
    x = 1
    await xds.sleep_ns(5)
    assert x == 2

@pytest.mark.xds
async def test_in_a_child_task():
    async def child():
        await xds.sleep_ns(5)
        assert xds.now_ns() == 6, "child's check"

    async with anyio.create_task_group() as tg:
        tg.start_soon(child)

@pytest.mark.xds
async def test_in_a_timer_callback():
    def callback():
        raise KeyError("from the callback")

    xds.current_runtime().call_at_ns(5, callback)
    await xds.sleep_ns(10)

@pytest.mark.xds
async def test_bad_argument():
    with xds.waiting_for(3):
        pass

@pytest.mark.xds
async def test_bad_die():
    from xds.fabric import UBFabric
    from xds.hw import CloudMatrix384

    UBFabric(CloudMatrix384()).post_write(0, 99999, 0, b"abc")

@pytest.mark.xds
async def test_bad_argument_inside_xccl():
    from xds.fabric import UBFabric
    from xds.fabric.xccl import XCCL
    from xds.fabric.xccl.p2p import AppBuffer
    from xds.hw import CloudMatrix384

    async with XCCL(UBFabric(CloudMatrix384(servers=1))) as xccl:
        await xccl.send(0, 3, AppBuffer(0, 4096), 0)
""",
    )
    result.assert_outcomes(failed=7)
    for backend in ("asyncio", "trio"):
        section = _failure_section(result, f"test_assert[{backend}]")
        assert ">       assert x == 2" in section and "E       assert 1 == 2" in section
        assert "_shows_the_users_line.py:10: AssertionError" in section
        assert "Run the given coroutine function" not in section
    section = _failure_section(result, "test_in_a_child_task")
    assert "assert xds.now_ns() == 6" in section and "child's check" in section
    section = _failure_section(result, "test_in_a_timer_callback")
    assert 'raise KeyError("from the callback")' in section
    for text in LIBRARY_TEXT:
        assert text not in section, (text, section)
    # a bad argument ends at the line that passed it, not inside xds or contextlib
    section = _failure_section(result, "test_bad_argument")
    assert ">       with xds.waiting_for(3):" in section
    assert "E       xds.errors.ConfigError: what: what must be text" in section
    assert "contextlib" not in section and "_check_note" not in section, section
    # however deep inside xds it was found (the fabric, its checks, the topology)
    section = _failure_section(result, "test_bad_die")
    assert '>       UBFabric(CloudMatrix384()).post_write(0, 99999, 0, b"abc")' in section
    assert "ub.py" not in section and "checks.py" not in section, section
    # inside 'async with XCCL(...)': no frame of its exit, nor the 'async with' line
    section = _failure_section(result, "test_bad_argument_inside_xccl")
    assert ">           await xccl.send(0, 3, AppBuffer(0, 4096), 0)" in section
    assert "__aexit__" not in section and ">       async with XCCL" not in section, section


def test_full_trace_still_shows_every_frame(pytester):
    result = run(
        pytester,
        """
import anyio

@pytest.mark.xds
async def test_deadlock():
    await anyio.Event().wait()
""",
        "--full-trace",
    )
    result.assert_outcomes(failed=1)
    section = _failure_section(result, "test_deadlock")
    assert "ModelDeadlock: model deadlock at t=0 ns" in section
    assert "xds/runtime/core.py" in section


def test_stacked_markers_that_conflict_are_an_error_naming_the_test(pytester):
    result = run(
        pytester,
        """
@pytest.mark.xds(seed=1)
@pytest.mark.xds(seed=2)
async def test_two_seeds():
    pass

@pytest.mark.xds(seed=1, backend="trio")
@pytest.mark.xds(backend="asyncio")
async def test_two_backends():
    pass

@pytest.mark.xds(seed=4)
@pytest.mark.xds(seed=4)
@pytest.mark.xds(event_log=False)
async def test_same_value_and_other_keywords():
    assert xds.current_runtime().seed == 4
    assert not xds.current_runtime().events.enabled

@pytest.mark.xds(seed=1)
@pytest.mark.xds(seed=2)
class TestStacked:
    async def test_in_class(self):
        pass

class TestOverride:
    pytestmark = [pytest.mark.xds(seed=8), pytest.mark.xds(seed=9)]

    @pytest.mark.xds(seed=3)
    async def test_own_marker_overrides_a_conflict_above(self):
        pass
""",
    )
    result.assert_outcomes(passed=1, errors=4)
    result.stdout.fnmatch_lines_random(
        [
            "*@pytest.mark.xds is stacked on test_two_seeds with conflicting seed=1 and seed=2;"
            " keep one marker*",
            "*@pytest.mark.xds is stacked on test_two_backends with conflicting"
            " backend='asyncio' and backend='trio'*",
            "*@pytest.mark.xds is stacked on TestStacked with conflicting seed=1 and seed=2*",
            "*@pytest.mark.xds is stacked on TestOverride with conflicting seed=8 and seed=9*",
        ]
    )
    assert "Traceback" not in result.stdout.str()


def test_logging_from_a_later_test_reaches_that_tests_stderr(pytester):
    """xds configures structlog at the first run; its logger once kept the stream that was
    sys.stderr then: under capsys, a later test's log call wrote to a closed file."""
    result = run(
        pytester,
        """
import structlog
from xds.runtime.logs import get_logger

@pytest.fixture(scope="module", autouse=True)
def fresh_structlog():
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()

@pytest.mark.xds
async def test_first(capsys):
    await xds.sleep_ns(5)

@pytest.mark.xds
async def test_second(capsys):
    get_logger("mine").warning("hello from the second test")
    assert "hello from the second test" in capsys.readouterr().err
""",
    )
    result.assert_outcomes(passed=2)


def test_the_backend_fixture_without_the_marker_says_what_is_missing(pytester):
    result = run(
        pytester,
        """
async def test_unmarked(xds_backend):
    await xds.sleep_ns(1)
""",
    )
    result.assert_outcomes(errors=2)  # once per backend, each told why
    assert "takes the xds_backend fixture but has no @pytest.mark.xds" in result.stdout.str()
