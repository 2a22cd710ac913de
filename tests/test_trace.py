"""Workloads: loaders (with their errors), generators, records and summaries."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xds.trace as t
from xds.errors import ConfigError, TraceError
from xds.trace.metrics import inter_token_ms

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_mooncake_jsonl(tmp_path):
    p = write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}\n'
        '{"timestamp": 9, "input_length": 30, "output_length": 3}\n',
    )
    w = t.load(p)
    assert [r.arrival_ns for r in w.requests] == [0, 4_000_000]
    assert w.requests[0].prefix_hashes == (1, 2) and w.requests[1].source_line == 2
    assert w.hash_block_tokens == 512  # Mooncake's hash_ids: one per 512-token block


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"timestamp": 1, "input_length": 100}\n', "line 1 field 'output_length': missing"),
        ('{"timestamp": 1, "input_length": -4, "output_length": 2}\n', "field 'input_length'"),
        ('{"timestamp": 1, "input_length": 1.5, "output_length": 2}\n', "expected an integer"),
        (
            '{"timestamp": 9, "input_length": 1, "output_length": 2}\n'
            '{"timestamp": 3, "input_length": 1, "output_length": 2}\n',
            "line 2 field 'timestamp'",
        ),
        ("not json\n", "line 1: invalid JSON"),
        (  # an ignored key nested past the decoder's recursion limit
            '{"timestamp": 1, "input_length": 1, "output_length": 2, "x": '
            + "[" * 5000
            + "]" * 5000
            + "}\n",
            "line 1: invalid JSON (nested too deeply to read)",
        ),
        (
            '{"timestamp": "5", "input_length": 1, "output_length": 2}\n',
            "line 1 field 'timestamp': expected a number, got the string '5'",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]}\n',
            "line 1 field 'hash_ids': 2 block hashes for 10 input tokens",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [-1]}\n',
            "field 'hash_ids': block hashes must be >= 0",
        ),
    ],
)
def test_malformed_mooncake_names_file_line_and_field(tmp_path, text, where):
    p = write(tmp_path, "bad.jsonl", text)
    with pytest.raises(TraceError) as info:
        t.load_mooncake(p)
    assert str(p) in str(info.value) and where in str(info.value)


def test_unsorted_timestamps_can_be_sorted(tmp_path):
    p = write(
        tmp_path,
        "u.jsonl",
        '{"timestamp": 9, "input_length": 1, "output_length": 2}\n'
        '{"timestamp": 3, "input_length": 5, "output_length": 2}\n',
    )
    w = t.load_mooncake(p, sort=True)
    assert [r.input_tokens for r in w.requests] == [5, 1]


def test_azure_and_request_csv(tmp_path):
    a = write(
        tmp_path,
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n",
    )
    w = t.load(a)
    assert [r.arrival_ns for r in w.requests] == [0, 52_000_000]
    v = write(
        tmp_path, "v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,2\n1.25,20,3\n"
    )
    w = t.load(v)
    assert [r.arrival_ns for r in w.requests] == [0, 750_000_000]
    bad = write(tmp_path, "b.csv", "arrived_at,num_prefill_tokens\n0,1\n")
    with pytest.raises(TraceError, match="field 'num_decode_tokens': missing column"):
        t.load_request_csv(bad)


def test_lengths_with_arrivals_and_explicit_drops(tmp_path):
    p = write(tmp_path, "l.csv", "in,out\n10,5\n0,3\n7,2\n")
    with pytest.raises(TraceError, match="line 3 field 'in'"):
        t.load_lengths(
            p, input_column="in", output_column="out", rng=np.random.default_rng(0), rate_per_s=10
        )
    w = t.load_lengths(
        p,
        input_column="in",
        output_column="out",
        rng=np.random.default_rng(0),
        rate_per_s=10,
        invalid="drop",
    )
    assert len(w) == 2 and w.dropped[0][0] == 3  # nothing disappears silently
    assert w.requests[0].arrival_ns == 0 < w.requests[1].arrival_ns


def test_generic_mapping_csv_and_jsonl(tmp_path):
    c = write(tmp_path, "g.csv", "t_ms,p,d\n0,11,4\n2,12,5\n")
    w = t.load_generic(
        c, mapping={"arrival": "t_ms", "input": "p", "output": "d"}, time_unit_ns=1_000_000
    )
    assert [r.arrival_ns for r in w.requests] == [0, 2_000_000]
    j = write(tmp_path, "g.jsonl", json.dumps({"at": 1, "i": 3, "o": 4, "h": [7]}) + "\n")
    w = t.load_generic(j, mapping={"arrival": "at", "input": "i", "output": "o", "hashes": "h"})
    assert w.requests[0].prefix_hashes == (7,)
    with pytest.raises(TraceError, match="line 1 field 'o': missing"):
        t.load_generic(
            write(tmp_path, "x.jsonl", '{"at": 1, "i": 3}\n'),
            mapping={"arrival": "at", "input": "i", "output": "o"},
        )


def test_generators_rate_scale_and_limit():
    w = t.fixed(2048, 2048, n=4, rate_per_s=2)
    assert [r.arrival_ns for r in w.requests] == [0, 500_000_000, 1_000_000_000, 1_500_000_000]
    assert [r.arrival_ns for r in w.scaled(2).requests][-1] == 750_000_000
    assert len(w.limited(2)) == 2
    rng = np.random.default_rng(0)
    s = t.synthetic(rng, 20_000, rate_per_s=100, cv=1.0, input_mean=1000, output_mean=100)
    gaps = np.diff([r.arrival_ns for r in s.requests])
    assert np.mean(gaps) == pytest.approx(1e7, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)
    b = t.synthetic(np.random.default_rng(1), 20_000, rate_per_s=100, cv=3.0)
    g = np.diff([r.arrival_ns for r in b.requests])
    assert np.std(g) / np.mean(g) == pytest.approx(3.0, rel=0.1)
    assert np.mean([r.input_tokens for r in s.requests]) == pytest.approx(1000, rel=0.05)


_TIME = st.integers(0, 10**13)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_TIME, st.lists(_TIME | st.integers(0, 3), max_size=6)), max_size=6))
def test_inter_token_ms_is_the_pairwise_formula(records):
    """The vectorised ITLs are exactly the per-pair ``(b - a) / 1e6``, in record order, of
    the pairs delivered apart (tokens delivered together make one gap)."""
    recs = [
        t.RequestRecord(i, 0, 1, len(times) + 1, first_token_ns=first, token_ns=times)
        for i, (first, times) in enumerate(records)
    ]
    plain = [
        (b - a) / 1e6
        for r in recs
        for a, b in zip([r.first_token_ns, *r.token_ns], r.token_ns, strict=False)
        if a != b
    ]
    fast = inter_token_ms(recs)
    assert fast.dtype == np.float64 and fast.tolist() == plain


def test_tokens_delivered_together_make_one_gap():
    """An MTP step's tokens share a time: a streaming client sees one gap, not a 0 per token."""
    ms = 1_000_000
    rec = t.RequestRecord(
        0,
        0,
        10,
        6,
        first_token_ns=5 * ms,
        finish_ns=30 * ms,
        token_ns=[15 * ms, 15 * ms, 20 * ms, 30 * ms, 30 * ms],
    )
    assert inter_token_ms([rec]).tolist() == [10.0, 5.0, 10.0]
    s = t.summarize([rec], chips=1)
    assert s.itl_ms.p50 == 10.0 and s.tpot_ms.mean == pytest.approx(25 / 5)


def test_summary_and_outputs(tmp_path):
    recs = [
        t.RequestRecord(
            0,
            0,
            100,
            11,
            first_token_ns=500_000_000,
            finish_ns=800_000_000,
            token_ns=[500_000_000 + 30_000_000 * i for i in range(1, 11)],
            cached_tokens=50,
        ),
        t.RequestRecord(
            1, 100_000_000, 100, 5, first_token_ns=2_600_000_000, finish_ns=2_800_000_000
        ),
        t.RequestRecord(2, 0, 10, 3, outcome="failed", reason="kv capacity"),
    ]
    t.check_complete(recs, 3)
    with pytest.raises(AssertionError):
        t.check_complete(recs[:2], 3)
    s = t.summarize(recs, chips=2)
    assert s.completed == 2 and s.failures == {"kv capacity": 1}
    assert s.ttft_ms.p50 == pytest.approx(1500)
    assert s.tpot_ms.mean == pytest.approx((30 + 50) / 2)
    assert s.itl_ms.mean == pytest.approx(30)
    assert s.goodput == pytest.approx(1 / 3)  # only request 0 meets TTFT < 2 s, TPOT < 35 ms
    assert s.prefix_hit_ratio == pytest.approx(50 / 200)  # over the completed requests
    t.write(tmp_path / "out", recs, s, csv=True)
    lines = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["reason"] == "kv capacity"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["completed"] == 2
    csv_lines = (tmp_path / "out" / "requests.csv").read_text().splitlines()
    assert len(csv_lines) == 4 and csv_lines[0].endswith(",cached_tokens,decode_wait_ns")
    assert csv_lines[1].endswith(",50,0")  # cached_tokens, decode_wait_ns


@needs_data
def test_real_traces_load():
    m = t.load(DATA / "mooncake" / "conversation_trace.jsonl")
    a = t.load(DATA / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv")
    assert len(m) == 12_031 and len(a) == 8_819
    assert all(r.prefix_hashes for r in m.requests[:100])
    v = t.load_lengths(
        DATA / "vidur_processed" / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
        input_column="num_prefill_tokens",
        output_column="num_decode_tokens",
        rng=np.random.default_rng(0),
        rate_per_s=2,
    )
    assert len(v) == 28_257


def test_generic_csv_hashes_and_physical_line_numbers(tmp_path):
    c = write(tmp_path, "h.csv", "t,i,o,h\n0,600,2,12 7\n\n1,x,2,3\n")
    with pytest.raises(TraceError, match="line 4 field 'i'"):
        t.load_generic(c, mapping={"arrival": "t", "input": "i", "output": "o", "hashes": "h"})
    ok = write(tmp_path, "ok.csv", "t,i,o,h\n0,600,2,12 7\n")
    w = t.load_generic(ok, mapping={"arrival": "t", "input": "i", "output": "o", "hashes": "h"})
    assert w.requests[0].prefix_hashes == (12, 7)
    m = write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 1, "input_length": 2, "output_length": 2, "hash_ids": ["a"]}\n',
    )
    with pytest.raises(TraceError, match="hash_ids"):
        t.load_mooncake(m)
    from xds.errors import ConfigError

    with pytest.raises(ConfigError, match="rate"):
        t.fixed(10, 10, n=2, rate_per_s=0)


@pytest.mark.parametrize(
    ("hashes", "says"),
    [
        ("[true, 1]", "expected a list of integers"),
        ("[1.9, 1]", "expected a list of integers"),  # 1.9 must not become a hit on 1
        ("[-3]", "block hashes must be >= 0"),
        ("[1, 2, 3]", "3 block hashes for 600 input tokens: a 512-token block each allows"),
        ('"1 2"', "expected a list of integers"),  # JSON has lists: not CSV's words
    ],
)
def test_generic_hashes_are_checked_as_mooncakes_are(tmp_path, hashes, says):
    j = write(tmp_path, "g.jsonl", f'{{"t": 0, "i": 600, "o": 5, "h": {hashes}}}\n')
    with pytest.raises(TraceError, match=rf"g\.jsonl:line 1 field 'h': {says}"):
        t.load_generic(j, mapping={"arrival": "t", "input": "i", "output": "o", "hashes": "h"})


def test_generic_hashes_carry_their_block_size_and_csv_hashes_are_digits(tmp_path):
    mapping = {"arrival": "t", "input": "i", "output": "o", "hashes": "h"}
    c = write(tmp_path, "h.csv", "t,i,o,h\n0,600,2,12;7\n1,40,2,\n")
    w = t.load_generic(c, mapping=mapping)
    assert w.hash_block_tokens == 512 and w.requests[0].prefix_hashes == (12, 7)
    w = t.load_generic(c, mapping=mapping, hash_block_tokens=16)
    assert w.hash_block_tokens == 16
    assert t.load_generic(c, mapping={k: mapping[k] for k in ("arrival", "input", "output")})
    bad = write(tmp_path, "b.csv", "t,i,o,h\n0,600,2,12 -7\n")
    with pytest.raises(TraceError, match=r"b\.csv:line 2 field 'h': expected integers >= 0"):
        t.load_generic(bad, mapping=mapping)
    from xds.errors import ConfigError

    with pytest.raises(ConfigError, match="hash_block_tokens"):
        t.load_generic(c, mapping=mapping, hash_block_tokens=0)
    # a mapped hashes column the file lacks, or a misspelt key, is an error, not "no hashes"
    lacking = write(tmp_path, "l.csv", "t,i,o\n0,600,2\n")
    with pytest.raises(TraceError, match=r"l\.csv:line 1 field 'h': missing column"):
        t.load_generic(lacking, mapping=mapping)
    j = write(tmp_path, "l.jsonl", '{"t": 0, "i": 600, "o": 2}\n')
    with pytest.raises(TraceError, match="no row has the hashes field 'h'"):
        t.load_generic(j, mapping=mapping)
    later = write(
        tmp_path, "m.jsonl", '{"t": 0, "i": 600, "o": 2}\n{"t": 1, "i": 9, "o": 2, "h": [4]}\n'
    )
    assert len(t.load_generic(later, mapping=mapping, limit=1)) == 1  # its rows were not all read
    with pytest.raises(TraceError, match="unknown mapping key 'hashs'"):
        t.load_generic(c, mapping={**mapping, "hashs": "h"})
    with pytest.raises(ConfigError, match="sort must be True or False, got 'no'"):
        t.load_generic(c, mapping=mapping, sort="no")  # type: ignore[arg-type]


def test_a_line_of_spaces_inside_a_csv_is_blank(tmp_path):
    p = write(
        tmp_path,
        "ws.csv",
        "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n   \n1,2,2\n",
    )
    w = t.load(p)
    assert [(r.input_tokens, r.source_line) for r in w.requests] == [(1, 2), (2, 4)]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300"])
def test_arrivals_must_be_finite_and_fit_the_clock(tmp_path, value):
    p = write(
        tmp_path, "r.csv", f"arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n{value},2,2\n"
    )
    with pytest.raises(TraceError, match=r"r\.csv:line 3 field 'arrived_at'"):
        t.load(p)
    g = write(tmp_path, "g.csv", f"t,i,o\n{value},1,1\n")
    with pytest.raises(TraceError, match=r"g\.csv:line 2 field 't'"):
        t.load_generic(g, mapping={"arrival": "t", "input": "i", "output": "o"})


def test_files_that_are_not_utf8_name_the_line(tmp_path):
    p = tmp_path / "l.csv"
    p.write_bytes(b"arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n1,\xff\xfe,2\n")
    with pytest.raises(TraceError, match=r"l\.csv:line 3: not UTF-8"):
        t.load(p)
    j = tmp_path / "m.jsonl"
    j.write_bytes(b'{"timestamp": 1, "input_length": 2, "output_length": 3, "x": "\xff"}\n')
    with pytest.raises(TraceError, match=r"m\.jsonl:line 1"):
        t.load(j)


def test_a_byte_order_mark_and_timestamp_offsets_are_read(tmp_path):
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbfarrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n0.5,2,2\n")
    assert [r.arrival_ns for r in t.load(p).requests] == [0, 500_000_000]
    a = write(
        tmp_path,
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900+00:00,10,5\n"
        "2023-11-16 18:15:47.1Z,10,5\n"
        "2023-11-16 20:15:48+02:00,10,5\n"  # 18:15:48 UTC
        "2023-11-16 18:15:49.25,10,5\n",  # no offset: UTC
    )
    assert [r.arrival_ns for r in t.load(a).requests] == [
        0,
        419_410_000,
        1_319_410_000,
        2_569_410_000,
    ]


def test_a_file_without_requests_is_an_error(tmp_path):
    p = write(tmp_path, "h.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n")
    with pytest.raises(TraceError, match=r"h\.csv: no requests"):
        t.load(p)
    lengths = write(tmp_path, "l.csv", "in,out\n0,3\n")
    with pytest.raises(TraceError, match=r"no requests in the file \(1 rows had unusable"):
        t.load_lengths(
            lengths,
            input_column="in",
            output_column="out",
            rng=np.random.default_rng(0),
            rate_per_s=1.0,
            invalid="drop",
        )


def test_sla_targets_must_be_positive_numbers():
    from xds.errors import ConfigError

    for bad in (dict(ttft_ms=-1.0), dict(tpot_ms=0.0), dict(tpot_ms=float("nan"))):
        with pytest.raises(ConfigError, match="_ms"):
            t.SLA(**bad)
    assert t.SLA(ttft_ms=float("inf")).ttft_ms == float("inf")  # no target on TTFT


def test_loaders_accept_what_they_can_read_and_name_the_files_own_columns(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_bytes(
        b'\xef\xbb\xbf{"timestamp": 0.5, "input_length": 10, "output_length": 2}\n'
        b'{"timestamp": 2, "input_length": 10.0, "output_length": 2}\n'
    )
    assert [r.arrival_ns for r in t.load(m).requests] == [0, 1_500_000]  # float ms, BOM
    c = write(tmp_path, "c.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10.0,2\n")
    assert t.load(c).requests[0].input_tokens == 10  # "10.0" as JSON's 10.0
    bad = write(tmp_path, "b.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10.5,2\n")
    with pytest.raises(TraceError, match="field 'num_prefill_tokens': expected an integer"):
        t.load(bad)
    az = write(
        tmp_path,
        "az.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:47,1,1\n"
        "2023-11-16 18:15:46,1,1\n",
    )
    with pytest.raises(TraceError, match="line 3 field 'TIMESTAMP': timestamps go backwards"):
        t.load(az)


def test_generic_jsonl_lines_must_be_objects(tmp_path):
    j = write(tmp_path, "a.jsonl", '{"at": 0, "i": 3, "o": 4}\n[1, 2]\n')
    with pytest.raises(TraceError, match=r"a\.jsonl:line 2: expected a JSON object"):
        t.load_generic(j, mapping={"arrival": "at", "input": "i", "output": "o"})


AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens"


def test_a_column_or_key_given_twice_is_an_error_naming_it(tmp_path):
    a = write(tmp_path, "a.csv", f"{AZ_HEAD},ContextTokens\n2023-11-16 18:17:03,10,5,99\n")
    with pytest.raises(TraceError, match=r"a\.csv:line 1 field 'ContextTokens': .*twice"):
        t.load(a)
    g = write(tmp_path, "g.csv", "t,i,o,i\n0,1,1,2\n")
    with pytest.raises(TraceError, match=r"g\.csv:line 1 field 'i': .*twice"):
        t.load_generic(g, mapping={"arrival": "t", "input": "i", "output": "o"})
    ok = write(tmp_path, "ok.csv", "t,i,o,note,note\n0,1,1,a,b\n")  # a column xds does not read
    assert len(t.load_generic(ok, mapping={"arrival": "t", "input": "i", "output": "o"})) == 1
    m = write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 0, "input_length": 6, "output_length": 3}\n'
        '{"timestamp": 1, "input_length": 600, "input_length": 5, "output_length": 3}\n',
    )
    with pytest.raises(TraceError, match=r"m\.jsonl:line 2 field 'input_length': .*twice"):
        t.load(m)
    # the key's name inside a string value is no second key
    s = write(
        tmp_path,
        "s.jsonl",
        '{"timestamp": 0, "input_length": 6, "output_length": 3, "note": "\\"input_length\\""}\n',
    )
    assert t.load(s).requests[0].input_tokens == 6


@pytest.mark.parametrize("value", ["1_000", "1e30", "1e3", "99999999999999999999", "+5", "0x10"])
def test_token_counts_in_csv_are_plain_integers_within_a_bound(tmp_path, value):
    rows = f"2023-11-16 18:17:03,10,5\n2023-11-16 18:17:04,34,{value}\n"
    p = write(tmp_path, "a.csv", f"{AZ_HEAD}\n{rows}")
    with pytest.raises(TraceError, match=r"a\.csv:line 3 field 'GeneratedTokens': "):
        t.load(p)


@pytest.mark.parametrize("value", ["1e30", "1e12", "1000000001", "true", "-3"])
def test_token_counts_in_json_are_integers_within_a_bound(tmp_path, value):
    line = f'{{"timestamp": 0, "input_length": 5, "output_length": {value}}}\n'
    p = write(tmp_path, "m.jsonl", line)
    with pytest.raises(TraceError, match=r"m\.jsonl:line 1 field 'output_length': "):
        t.load(p)


def test_the_token_bound_is_a_billion(tmp_path):
    line = '{"timestamp": 0, "input_length": 5, "output_length": 1000000000}\n'
    p = write(tmp_path, "m.jsonl", line)
    assert t.load(p).requests[0].output_tokens == t.loaders.MAX_TOKENS == 10**9
    c = write(tmp_path, "c.csv", f"{AZ_HEAD}\n2023-11-16 18:17:03, 12 ,5.0\n")
    assert (t.load(c).requests[0].input_tokens, t.load(c).requests[0].output_tokens) == (12, 5)


def test_format_guessing_skips_leading_blank_lines_as_the_loaders_do(tmp_path):
    line = '{"timestamp": 0, "input_length": 6, "output_length": 3}\n'
    m = write(tmp_path, "m.jsonl", "\n  \n" + line)
    assert t.loaders.guess_format(m) == "mooncake"
    assert t.load(m).requests[0].source_line == 3
    rows = "2023-11-16 18:17:03,10,5\n2023-11-16 18:17:04,x,5\n"
    a = write(tmp_path, "a.csv", f"\n\n{AZ_HEAD}\n{rows}")
    assert t.loaders.guess_format(a) == "azure"
    with pytest.raises(TraceError, match=r"a\.csv:line 5 field 'ContextTokens'"):
        t.load(a)
    b = write(tmp_path, "b.csv", "\narrived_at,num_prefill_tokens\n0,1\n")
    with pytest.raises(TraceError, match=r"b\.csv:line 2 field 'num_decode_tokens': missing col"):
        t.load(b)
    e = write(tmp_path, "e.jsonl", "\n \n")
    with pytest.raises(TraceError, match=r"e\.jsonl: no requests in the file"):
        t.load(e)


def test_a_column_is_found_wherever_it_stands_and_whatever_spaces_pad_its_name(tmp_path):
    """The Azure format was guessed only from a header starting with TIMESTAMP, and header
    names were not trimmed as values are."""
    a = write(tmp_path, "a.csv", "id,TIMESTAMP,ContextTokens,GeneratedTokens,note\n")
    a.write_text(a.read_text() + "7,2023-11-16 18:17:03,12,5,x\n")
    assert t.loaders.guess_format(a) == "azure"
    assert (t.load(a).requests[0].input_tokens, t.load(a).requests[0].output_tokens) == (12, 5)
    r = write(tmp_path, "r.csv", "arrived_at , num_prefill_tokens, num_decode_tokens\n0,10 , 3\n")
    assert t.loaders.guess_format(r) == "request-csv"
    assert (t.load(r).requests[0].input_tokens, t.load(r).requests[0].output_tokens) == (10, 3)
    n = write(tmp_path, "n.csv", "not_arrived_at_all,x\n0,1\n")
    with pytest.raises(TraceError, match="cannot tell the trace format"):
        t.load(n)


def test_format_advice_names_what_python_takes(tmp_path):
    p = write(tmp_path, "sg.csv", "prompt_tokens,completion_tokens\n34,244\n")
    with pytest.raises(TraceError) as info:
        t.load(p)
    assert "load_lengths" in str(info.value) and hasattr(t, "load_lengths")
    assert "this looks like a lengths-only CSV" in str(info.value)  # its default columns
    assert "--format lengths --rate R" in str(info.value)
    with pytest.raises(TraceError, match=r"load_lengths\(path, input_column="):
        t.load(p, fmt="lengths")
    with pytest.raises(TraceError, match="known: mooncake, azure, request-csv, servegen"):
        t.load(p, fmt="vidur")


def test_a_limit_keeps_only_the_dropped_rows_it_read(tmp_path):
    p = write(tmp_path, "l.csv", "in,out\n10,5\n0,3\n7,2\n,4\n9,9\n")
    w = t.load_lengths(
        p,
        input_column="in",
        output_column="out",
        rng=np.random.default_rng(0),
        rate_per_s=10,
        invalid="drop",
    )
    assert [line for line, _ in w.dropped] == [3, 5]
    assert [line for line, _ in w.limited(2).dropped] == [3]  # line 5 came after the 2nd request
    assert [line for line, _ in w.limited(1).dropped] == []


def test_kv_transfer_leaves_out_requests_without_decode(tmp_path):
    def rec(i, out, kv):
        return t.RequestRecord(
            i, 0, 100, out, first_token_ns=10, finish_ns=10 + out, kv_transfer_ns=kv
        )

    s = t.summarize([rec(0, 1, 0), rec(1, 5, 4_000_000), rec(2, 1, 0)], chips=3)
    assert s.kv_transfer_ms.mean == pytest.approx(4.0) and s.kv_transfer_ms.p50 == pytest.approx(4)
    assert s.chips == 3
    only_one = t.summarize([rec(0, 1, 0)], chips=1)
    assert np.isnan(only_one.kv_transfer_ms.mean)


def test_records_carry_their_trace_line(tmp_path):
    p = write(
        tmp_path,
        "u.jsonl",
        '{"timestamp": 9, "input_length": 1, "output_length": 2}\n\n'
        '{"timestamp": 3, "input_length": 5, "output_length": 2}\n',
    )
    w = t.load_mooncake(p, sort=True)
    recs = [
        t.RequestRecord(r.request_id, r.arrival_ns, 1, 2, source_line=r.source_line)
        for r in w.requests
    ]
    assert [r.source_line for r in recs] == [3, 1]
    t.write(tmp_path / "o", recs, t.summarize(recs, chips=1), csv=True)
    lines = [json.loads(x) for x in (tmp_path / "o" / "requests.jsonl").read_text().splitlines()]
    assert [x["source_line"] for x in lines] == [3, 1]
    rows = (tmp_path / "o" / "requests.csv").read_text().splitlines()
    assert rows[0].startswith("request_id,source_line,") and rows[1].startswith("0,3,")


def test_write_removes_a_csv_it_does_not_rewrite(tmp_path):
    recs = [t.RequestRecord(0, 0, 1, 1, first_token_ns=1, finish_ns=1)]
    s = t.summarize(recs, chips=1)
    t.write(tmp_path, recs, s, csv=True)
    (tmp_path / "mine.txt").write_text("keep")
    t.write(tmp_path, recs, s)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mine.txt",
        "requests.jsonl",
        "summary.json",
    ]


def test_azure_timestamps_take_a_comma_as_the_decimal_sign(tmp_path):
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    rows = '2023-11-16 18:15:46.5,3,2\n"2023-11-16 18:15:46,75",3,2\n'
    w = t.load_azure(write(tmp_path, "a.csv", head + rows))
    assert [r.arrival_ns for r in w.requests] == [0, 250_000_000]


def test_a_limit_reads_a_file_only_up_to_its_nth_request(tmp_path):
    bad_late = "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n1,2,2\n2,0,2\n"
    p = write(tmp_path, "r.csv", bad_late)
    assert [r.input_tokens for r in t.load(p, limit=2).requests] == [1, 2]
    with pytest.raises(TraceError, match="line 4"):
        t.load(p)  # the whole file: its bad row counts
    with pytest.raises(TraceError, match="line 4"):
        t.load(p, sort=True, limit=2)  # sorting needs every row
    lengths = write(tmp_path, "l.csv", "i,o\n0,3\n5,3\n6,3\n7,0\n")
    w = t.load_lengths(
        lengths,
        input_column="i",
        output_column="o",
        rng=np.random.default_rng(0),
        rate_per_s=1.0,
        invalid="drop",
        limit=2,
    )
    assert [r.input_tokens for r in w.requests] == [5, 6] and [d[0] for d in w.dropped] == [2]
    with pytest.raises(ConfigError, match="limit: must be an integer >= 1"):
        t.load(p, limit=0)


def test_json_token_counts_are_numbers_not_strings(tmp_path):
    row = '{{"timestamp": 0, "input_length": {}, "output_length": 5, "hash_ids": []}}\n'
    assert (
        t.load_mooncake(write(tmp_path, "a.jsonl", row.format("1e3"))).requests[0].input_tokens
        == 1000
    )
    with pytest.raises(
        TraceError, match=r"field 'input_length': expected a number, got '10' \(a string\)"
    ):
        t.load_mooncake(write(tmp_path, "b.jsonl", row.format('"10"')))
    g = write(tmp_path, "g.jsonl", '{"t": 0, "i": "7", "o": 2}\n')
    with pytest.raises(TraceError, match="expected a number"):
        t.load_generic(g, mapping={"arrival": "t", "input": "i", "output": "o"})


def test_generic_loader_checks_its_time_unit_and_reads_json_suffixes_in_any_case(tmp_path):
    rows = [{"t": 0, "i": 10, "o": 5}, {"t": 20, "i": 10, "o": 5}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    mapping = {"arrival": "t", "input": "i", "output": "o"}
    for name in ("gen.JSONL", "gen.ndjson"):
        (tmp_path / name).write_text(text)
        w = t.load_generic(tmp_path / name, mapping=mapping, time_unit_ns=1_000_000)
        assert [r.arrival_ns for r in w.requests] == [0, 20_000_000]
    for unit in (0, -1_000_000, float("nan"), float("inf"), True, "ms"):
        with pytest.raises(ConfigError) as err:
            t.load_generic(tmp_path / "gen.ndjson", mapping=mapping, time_unit_ns=unit)
        assert err.value.field == "time_unit_ns"


def test_a_loader_stopped_by_its_limit_says_so_in_the_source(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(
        "".join(
            json.dumps({"timestamp": k, "input_length": 10, "output_length": 5}) + "\n"
            for k in range(5)
        )
    )
    assert t.load(p, limit=2).source == f"{p}, first 2"
    assert t.load(p, limit=2, sort=True).source == f"{p}, first 2"
    assert t.load(p).source == str(p)
    lengths = tmp_path / "l.csv"
    lengths.write_text("a,b\n10,5\n20,6\n30,7\n")
    gen = np.random.default_rng(0)
    w = t.load_lengths(lengths, input_column="a", output_column="b", rng=gen, rate_per_s=5, cv=2)
    assert w.source == f"{lengths} (columns a/b, Gamma cv 2 at 5 req/s)"
    for bad, field in ((dict(cv=float("nan")), "cv"), (dict(rng=None), "rng")):
        kwargs = dict(input_column="a", output_column="b", rng=gen, rate_per_s=5) | bad
        with pytest.raises(ConfigError) as err:
            t.load_lengths(lengths, **kwargs)
        assert err.value.field == field


def test_lengths_loader_takes_numpy_numbers_for_its_arrival_process(tmp_path):
    p = tmp_path / "l.csv"
    p.write_text("a,b\n10,5\n20,6\n30,7\n")

    def arrivals(cv):
        gen = np.random.default_rng(0)
        w = t.load_lengths(p, input_column="a", output_column="b", rng=gen, rate_per_s=5, cv=cv)
        return [r.arrival_ns for r in w.requests]

    assert arrivals(np.int64(2)) == arrivals(np.float32(2.0)) == arrivals(2)


def test_a_csv_field_of_prompt_text_is_read_and_an_overlong_one_names_its_line(
    tmp_path, monkeypatch
):
    import csv

    import xds.trace.loaders as loaders

    text = "word " * 40_000  # 200 kB: over the csv module's 128 KiB default field limit
    head = "prompt,arrived_at,num_prefill_tokens,num_decode_tokens\n"
    p = write(tmp_path, "v.csv", f'{head}"hi",0,5,2\n"{text}",1,9,3\n')
    w = t.load(p)
    assert [r.input_tokens for r in w.requests] == [5, 9]
    assert csv.field_size_limit() == 131_072  # the process's limit is left as it was
    monkeypatch.setattr(loaders, "_CSV_FIELD_BYTES", 1000)  # the default limit applies
    with pytest.raises(TraceError, match=r"v\.csv:line 3: not readable as CSV: field larger"):
        t.load(p)


def test_tied_timestamps_spread_over_their_step_in_order():
    reqs = [(0, 10), (0, 11), (0, 12), (3_000, 13), (6_000, 14), (6_000, 15)]
    w = t.Workload(
        tuple(t.Request(i, a * 1_000_000, x, 5) for i, (a, x) in enumerate(reqs)), "f.jsonl"
    )
    assert w.tied() == 3
    a = w.spread_ties(np.random.default_rng(1))
    b = w.spread_ties(np.random.default_rng(1))
    arrivals = [r.arrival_ns for r in a.requests]
    assert a == b and a.tied() == 0  # seeded: the same spread
    assert arrivals == sorted(arrivals) and [r.input_tokens for r in a.requests] == [
        10,
        11,
        12,
        13,
        14,
        15,
    ]
    assert all(0 <= x < 3_000_000_000 for x in arrivals[:3]) and arrivals[3] == 3_000_000_000
    assert all(6_000_000_000 <= x < 9_000_000_000 for x in arrivals[4:])  # the last: median step
    assert "spread over its step (median 3 s)" in a.source
    untied = t.Workload(w.requests[2:5], "g")
    assert untied.spread_ties(np.random.default_rng(1)) is untied
    one_stamp = t.Workload(w.requests[:3], "h")  # no step to spread over: left as it is
    assert one_stamp.spread_ties(np.random.default_rng(1)) is one_stamp


def test_a_record_spanning_lines_is_named_by_its_first_line(tmp_path):
    # quoted prompt text with line breaks (LF and CRLF), and a blank line between records
    text = (
        "arrived_at,num_prefill_tokens,num_decode_tokens,text\r\n"
        '0,10,10,"a\r\nb\r\nc"\r\n'
        "\r\n"
        '1,20,10,"d\ne"\r\n'
        "2,30,3,y\r\n"
    )
    p = tmp_path / "multi.csv"
    p.write_bytes(text.encode())
    w = t.load(p, "request-csv")
    assert [r.source_line for r in w.requests] == [2, 6, 8]
    p.write_bytes(text.replace("2,30,3", "2,x,3").encode())
    with pytest.raises(TraceError) as err:
        t.load(p, "request-csv")
    assert err.value.line == 8


def test_one_column_for_two_quantities_is_refused(tmp_path):
    p = write(tmp_path, "same.csv", "t,n\n0,600\n1,700\n")
    with pytest.raises(TraceError, match="'input' and 'output' both name column 'n'") as err:
        t.load_generic(p, mapping={"arrival": "t", "input": "n", "output": "n"})
    assert err.value.field == "output"
    with pytest.raises(TraceError, match="both name 'n'") as err:
        t.load_lengths(
            p, input_column="n", output_column="n", rng=np.random.default_rng(0), rate_per_s=1
        )
    assert err.value.field == "output_column"


def test_timestamps_centuries_apart_are_an_error_naming_the_line_not_an_overflow(tmp_path):
    f = tmp_path / "azure.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "1700-01-01 00:00:00,100,10\n"
        "2023-11-16 18:17:03,100,10\n"
    )
    with pytest.raises(TraceError, match=r"324 years after the first request \(line 2\)") as e:
        t.load_azure(f)
    assert (e.value.line, e.value.field) == (3, "TIMESTAMP")
    # within the clock's range but beyond what a replay serves: the replay names the row
    from xds.serve.replay import replay

    f.write_text(f.read_text().replace("1700", "1970"))
    with pytest.raises(ConfigError, match=r"request 1 \(line 3\) arrives 19677.8 days after"):
        replay(t.load_azure(f))
