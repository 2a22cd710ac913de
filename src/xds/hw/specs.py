"""Hardware specifications, each number with its source (SPEC.md section 1, REFERENCE.md 1).

Every field's description names its source and grade, as in REFERENCE.md: **P** primary
(vendor file, paper), **S** secondary (third-party summary), **D** derived by arithmetic,
**[emulator choice]** where no public number exists (SPEC.md Appendix B). ``xds info --sources``
prints them. Bandwidths are bytes per second, unidirectional; latencies are nanoseconds.

Source tags (full references in REFERENCE.md): CANN = ``hicann/runtime`` platform ini files
(Ascend910_9391.ini, Ascend910B2.ini); CMI = Zuo et al., arXiv:2506.12708; CMI-S3 = a summary of
the UB-Mesh and CloudMatrix384 papers; EM = emergentmind summary of CMI; BH = besthub article
on CloudMatrix384; LLS = JiusiServe/light-llm-simulator hardware profile; XDS = arXiv:2508.02520.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated

import msgspec
from msgspec import Meta

from xds.config import check_fields
from xds.units import GB, TB, GiB, KiB, MiB

from ..docfields import document_fields


def _d(text: str) -> Meta:
    return Meta(description=text)


class DieSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One die (an Ascend 910C has two; an Ascend 910B has one)."""

    name: str
    aic: Annotated[int, Meta(ge=1), _d("AI cube cores. CANN cube_core_cnt=24 [P]")] = 24
    aiv: Annotated[
        int,
        Meta(ge=1, le=48),
        _d("AI vector cores. CANN vector_core_cnt=48 [P]; XDS P035 'up to 48 AIVs per die'"),
    ] = 48
    ai_cpu: Annotated[int, Meta(ge=0), _d("User AI CPU cores. CANN ai_cpu_cnt=6 [P]")] = 6
    dma_engines: Annotated[
        int, Meta(ge=1), _d("DMA engines per die. [emulator choice] SPEC App. B default 4")
    ] = 4
    cube_clock_hz: Annotated[
        float, Meta(gt=0), _d("Cube clock. CANN cube_freq 1850 MHz (SKU 9391) [P]")
    ] = 1.85e9
    bf16_flops: Annotated[
        float,
        Meta(gt=0),
        _d(
            "BF16 dense peak. ~376 TFLOPS per die (752 per chip) [S x2: EM, CMI-S3]; CANN "
            "cube geometry gives 363.7 TFLOPS at 1.85 GHz [D], a 3% cross-check"
        ),
    ] = 376e12
    int8_ops: Annotated[
        float,
        Meta(gt=0),
        _d(
            "INT8 dense peak, 2x BF16 (CANN DtypeMKN int8 16x32x16) [D]; CMI normalisation "
            "implies 1504 TOPS per chip [D]"
        ),
    ] = 752e12
    vector_flops: Annotated[
        float, Meta(gt=0), _d("Vector (AIV) FP16 peak. LLS A3Pod profile 22 TFLOPS [unofficial]")
    ] = 22e12
    hbm_bytes: Annotated[
        int, Meta(gt=0), _d("HBM capacity 64 GiB. CANN memory_size=68719476736 [P]")
    ] = 64 * GiB
    hbm_bandwidth: Annotated[
        float, Meta(gt=0), _d("HBM bandwidth 1.6 TB/s per die [S x2: EM, CMI-S3; LLS]")
    ] = 1.6 * TB
    l2_bytes: Annotated[int, Meta(gt=0), _d("L2 cache 192 MiB. CANN l2_size [P]")] = 192 * MiB
    ubuf_bytes: Annotated[
        int,
        Meta(gt=0),
        _d("Unified Buffer per AIV, 192 KiB. CANN ub_size=196608 [P]; SPEC App. B ubuf_bytes"),
    ] = 192 * KiB

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def mte_max_bytes(self) -> int:
        """Largest single MTE operation: half a UBuf (ping-pong halves, SPEC 1.5)."""
        return self.ubuf_bytes // 2


class LinkSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One network as seen from one endpoint: bandwidth per endpoint and base latency."""

    name: str
    bandwidth: Annotated[float, Meta(gt=0), _d("Unidirectional bandwidth per endpoint, B/s")]
    latency_ns: Annotated[int, Meta(ge=0), _d("Base one-way latency of a small operation, ns")]
    source: str = ""
    """Where bandwidth and latency come from."""

    def __post_init__(self) -> None:
        check_fields(self)


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Cost parameters of the data movers and XCCL kernels (SPEC 1.4, 3.7, App. B).

    SPEC 3.7's cost form: ``T = t_launch + t_meta + S / min(n_aiv * b_aiv, B_link)``.
    """

    kernel_launch_ns: Annotated[
        int, Meta(ge=0), _d("t_launch: XCCL kernel launch. [emulator choice] SPEC App. B 3 us")
    ] = 3_000
    meta_write_ns: Annotated[
        int, Meta(ge=0), _d("t_meta: one metadata write/poll round. [emulator choice] App. B 1 us")
    ] = 1_000
    aiv_mte_bandwidth: (
        Annotated[
            float,
            Meta(gt=0),
            _d(
                "b_aiv: MTE2/MTE3 throughput one AIV sustains. Default (None): derived per die as "
                "HBM bandwidth / AIVs (1.6 TB/s / 48 = 33.3 GB/s on 910C) [D]: MTE2 streams "
                "from HBM and a die's AIVs together saturate it. SPEC App. B's illustrative "
                "value is 35 GB/s"
            ),
        ]
        | None
    ) = None
    mte_startup_ns: Annotated[
        int,
        Meta(ge=0),
        _d("MTE operation start-up. [emulator choice] below DMA start-up (SPEC 1.5): 0.5 us"),
    ] = 500
    dma_startup_ns: Annotated[
        int, Meta(ge=0), _d("DMA/URMA start-up. [emulator choice] SPEC App. B 10 us")
    ] = 10_000
    meta_issue_ns: Annotated[
        int,
        Meta(ge=0),
        _d(
            "Scalar work of one AIV to address and issue one remote metadata write (per "
            "destination of a collective; SPEC 5.6 'per-destination scalar and metadata work'). "
            "[emulator choice] 100 ns: ~185 scalar cycles at 1.85 GHz"
        ),
    ] = 100
    a2a_congestion: Annotated[
        float,
        Meta(ge=0),
        _d(
            "c in the all-to-all link efficiency 1 / (1 + c log2 F), F = peers a die exchanges "
            "with at once in a collective (1 for point-to-point). Least-squares fit (0.2045) "
            "to DeepEP-Ascend normal-mode BF16 combine bottleneck bandwidth on the A3 "
            "SuperPOD: 125/103/95/91/81 GB/s at EP8/16/32/64/128 of 196 GB/s "
            "(sgl-project/sgl-kernel-npu README, REFERENCE.md DEEPEP-ASC); fit within 0.025"
        ),
    ] = 0.2045
    vector_ops_per_quant_element: Annotated[
        int,
        Meta(ge=1),
        _d(
            "Vector operations per element of token-wise INT8 (de)quantisation: |x|, max, "
            "scale, round/convert. [emulator choice] 4; time = ops / die vector peak"
        ),
    ] = 4
    quant_fixed_ns: Annotated[
        int,
        Meta(ge=0),
        _d(
            "Fixed part of a token-wise INT8 quantisation fused into a sending kernel (SPEC "
            "9.3: a fixed part plus a per-token part, charged on the sender): the AIV pipeline "
            "hand-offs MTE2 load -> vector |x| and max -> scalar scale -> vector scale and "
            "casts -> MTE3 store, each a set/wait flag pair. [emulator choice] 4 x ~230 cycles "
            "at 1.85 GHz, 500 ns"
        ),
    ] = 500

    def __post_init__(self) -> None:
        check_fields(self)


def aiv_mte_bandwidth(engines: EngineSpec, die: DieSpec) -> float:
    """b_aiv of ``die``: the explicit engine value, else HBM bandwidth / AIVs per die."""
    return engines.aiv_mte_bandwidth or die.hbm_bandwidth / die.aiv


def collective_efficiency(engines: EngineSpec, fan: int) -> float:
    """Fraction of link bandwidth a transfer gets when its die juggles ``fan`` peers at once."""
    return 1.0 / (1.0 + engines.a2a_congestion * math.log2(max(int(fan), 1)))


class Network(StrEnum):
    """Which network joins two dies (SPEC 1.2)."""

    LOCAL = "local"
    """Same die: device memory, no network."""
    NOC = "noc"
    """The two dies of one chip: on-chip network."""
    UB = "ub"
    """Scale-up Unified Bus: any two dies of one CloudMatrix384 pod."""
    HCCS = "hccs"
    """Scale-up inside an Ascend 910B server (8-chip full mesh)."""
    ROCE = "roce"
    """Scale-out RDMA: between pods, and between a pod and 910B servers."""
    VPC = "vpc"
    """Virtual private cloud: service ingress and external systems."""


ASCEND_910C_DIE = DieSpec(name="Ascend 910C die")

ASCEND_910B2 = DieSpec(
    name="Ascend 910B2",
    aic=24,
    aiv=48,
    cube_clock_hz=1.8e9,
    bf16_flops=353.8e12,  # LLS Ascend 910B2 profile; CANN 910B2 ini geometry at 1.8 GHz [D]
    int8_ops=707.9e12,  # LLS
    hbm_bytes=64 * GiB,  # CANN Ascend910B2.ini
    hbm_bandwidth=1.6 * TB,  # LLS
)

UB_LINK = LinkSpec(
    name="UB",
    bandwidth=196 * GB,
    latency_ns=1_200,
    source="196 GB/s unidirectional per die, 7 UB transceivers [S: BH, CMI-S3, CMI-S1; LLS]; "
    "512 B NPU-to-NPU read ~1.2 us [S: CMI-S3, CMI-S1]. SPEC App. B suggests 200 GB/s.",
)
NOC_LINK = LinkSpec(
    name="NoC",
    bandwidth=196 * GB,
    latency_ns=1_200,
    source="[emulator choice] equal to UB by default (SPEC 1.5); LLS models 224 GB/s die-to-die",
)
ROCE_LINK = LinkSpec(
    name="RoCE",
    bandwidth=25 * GB,
    latency_ns=3_000,
    source="200 Gb/s RDMA interface per die [S: CMI-S3, BH]; 3 us one-way [emulator choice]",
)
HCCS_LINK = LinkSpec(
    name="HCCS",
    bandwidth=196 * GB,
    latency_ns=1_500,
    source="910B HCCS 196 GB/s per chip [LLS model value]; 1.5 us [emulator choice]",
)
B_SCALE_OUT_LINK = LinkSpec(
    name="910B RoCE",
    bandwidth=50 * GB,
    latency_ns=3_000,
    source="Ascend 910B2 scale-out 50 GB/s per die [LLS model value; REFERENCE.md 1.2]; 3 us "
    "one-way [emulator choice, as RoCE]",
)
VPC_LINK = LinkSpec(
    name="VPC",
    bandwidth=50 * GB,
    latency_ns=20_000,
    source="400 Gb/s per server via Qingtian DPU [S: CMI-S3]; 20 us one-way [emulator choice]",
)
DEFAULT_ENGINES = EngineSpec()


def sources(spec: type[msgspec.Struct]) -> dict[str, str]:
    """Field name -> source note, for a spec class whose fields carry descriptions."""
    out: dict[str, str] = {}
    info = msgspec.inspect.type_info(spec)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        t = field.type
        if isinstance(t, msgspec.inspect.UnionType):  # an optional field
            t = next((u for u in t.types if isinstance(u, msgspec.inspect.Metadata)), t)
        if isinstance(t, msgspec.inspect.Metadata) and t.extra_json_schema:
            desc = t.extra_json_schema.get("description")
            if desc:
                out[field.name] = desc
    return out


document_fields(DieSpec, EngineSpec, LinkSpec)
