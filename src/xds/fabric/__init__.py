"""The UB fabric: per-die device memory, remote access with injected latency, XCCL.

Built on :mod:`xds.hw` (costs) and :mod:`xds.runtime` (virtual time). See SPEC.md sections 1
and 3-5 and ARCHITECTURE.md "Layers".
"""
