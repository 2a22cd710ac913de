"""Where the benchmarks find the shared public traces (``../shared/data``, next to the repo)."""

from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
MOONCAKE_CONVERSATION = TRACES / "mooncake" / "conversation_trace.jsonl"
