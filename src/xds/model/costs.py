"""Kernel cost model: the time of each decode/prefill kernel on one die (SPEC 2, 6, 9).

A kernel's time is the larger of its compute time (FLOPs at the die's peak for its data type
times a compute efficiency) and its memory time (bytes at HBM bandwidth times a memory
efficiency). Efficiencies come from CloudMatrix-Infer's measurements on the same chip
(Zuo et al., arXiv:2506.12708, "CMI" in REFERENCE.md), an experiment independent of the
xDeepServe results xds reproduces:

=========================  ======  =====================================================
factor                     value   source
=========================  ======  =====================================================
attention_compute          0.654   CMI: MLA compute utilisation (BF16) 65.4 %
attention_memory           0.841   CMI: MLA memory-bandwidth utilisation 84.1 %
gemm_compute               0.80    CMI: INT8 GEMM compute utilisation 77.4-82.7 %
memory (other kernels)     0.841   as MLA; CMI reports no other memory utilisation
graph_launch_ns            0.7 ms  CMI: each graph dispatch adds 0.6-0.8 ms
eager_op_dispatch_ns       30 us   [emulator choice] host dispatch per operator (SPEC 2.1)
=========================  ======  =====================================================

Shapes follow the model spec (:mod:`xds.model.specs`). MLA runs in the absorbed form used for
decode: the query is projected into the 512-dim latent, attention reads the cached latent plus
the RoPE key once per sequence (MTP tokens of a sequence share the read), and the output goes
back through the absorbed value and output projections. GQA (Qwen3-235B, GLM-4.5) projects
the query heads and the fewer key/value heads from the hidden state (with a per-head
RMSNorm on queries and keys where the model has QK-norm), attends over the cached keys and
values (read once per sequence, shared by its query heads and MTP tokens) and projects back.
The same efficiencies apply: CMI measured MLA, and a GQA decode kernel is as memory-bound
([emulator choice]; no public Ascend measurement of GQA utilisation). Hybrid linear
attention (MiniMax-M1's lightning layers) is not modelled.

:meth:`CostModel.attention_prolog`, :meth:`CostModel.attention_core` and
:meth:`CostModel.attention_output` pick the model's family; the ``mla_*`` and ``gqa_*``
methods are the families' own kernels.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..config import check_fields
from ..docfields import document_fields
from ..errors import ConfigError
from ..hw import DieSpec
from .specs import ModelSpec

Engine = Literal["cube_int8", "cube_bf16", "vector"]


class KernelEfficiency(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shares of the die's peak each kind of kernel reaches (0.001 .. 1: below a thousandth a
    kernel's time overflows any meaningful run)."""

    attention_compute: Annotated[float, Meta(ge=0.001, le=1)] = 0.654
    attention_memory: Annotated[float, Meta(ge=0.001, le=1)] = 0.841
    gemm_compute: Annotated[float, Meta(ge=0.001, le=1)] = 0.80
    memory: Annotated[float, Meta(ge=0.001, le=1)] = 0.841
    vector_compute: Annotated[float, Meta(ge=0.001, le=1)] = 0.5
    """[emulator choice] vector kernels (norms, sampling) are memory-bound in practice."""
    graph_launch_ns: Annotated[int, Meta(ge=0)] = 700_000
    eager_op_dispatch_ns: Annotated[int, Meta(ge=0)] = 30_000

    def __post_init__(self) -> None:
        check_fields(self)


class Precision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which components run in INT8 (SPEC 9.2); each switch changes cost only."""

    mla_int8: bool = True
    """Wq_a, Wkv_a, Wq_b and Wo as INT8 QMM (P087); for a GQA model, its q, k, v and o
    projections ([emulator choice], the same W8A8 scheme)."""
    moe_int8: bool = True
    """All expert weights and the dense MLP as INT8 QMM (P088)."""
    kv_int8_nope: bool = True
    """The non-RoPE latent of the KV cache in INT8 (P090); for a GQA model, its keys and
    values ([emulator choice]: an INT8 KV cache, as Ascend serves GQA models with)."""
    attention_int8: bool = False
    """The whole attention computation in INT8 on every layer (P090)."""
    attention_int8_layers: tuple[int, ...] = ()
    """Decoder layers (0-based; the MTP layer is number ``layers``) whose whole attention runs
    in INT8: P090's precision-insensitive layers, which the paper does not name."""
    lm_head_bf16: bool = True

    def __post_init__(self) -> None:
        check_fields(self)
        layers = self.attention_int8_layers
        if len(set(layers)) != len(layers):
            twice = sorted({x for x in layers if layers.count(x) > 1})
            raise ConfigError(
                f"attention_int8_layers names layer(s) {twice} more than once",
                field="precision.attention_int8_layers",
            )
        if any(layer < 0 for layer in self.attention_int8_layers):
            raise ConfigError(
                f"attention_int8_layers must be layer numbers >= 0, got "
                f"{list(self.attention_int8_layers)}",
                field="precision.attention_int8_layers",
            )

    def check_layers(
        self, model: ModelSpec, *, field: str = "precision.attention_int8_layers"
    ) -> None:
        """Every layer named in ``attention_int8_layers`` exists in ``model``."""
        last = model.layers if model.mtp_layers else model.layers - 1
        beyond = [x for x in self.attention_int8_layers if x > last]
        if beyond:
            mtp = f" (and its MTP layer, {model.layers})" if model.mtp_layers else " (no MTP layer)"
            raise ConfigError(
                f"{model.name} has layers 0..{model.layers - 1}{mtp}; attention_int8_layers "
                f"names {beyond}",
                field=field,
            )

    def weight_bytes(
        self, model: ModelSpec, *, experts: int = 0, tp: int = 1, mtp: bool = False
    ) -> int:
        """Bytes of weights one die holds: attention, dense MLP and ``experts`` expert
        instances (per MoE layer, e.g. routed + redundant + shared slots) at 1 byte per
        parameter in INT8 (``mla_int8`` for Wq_a, Wkv_a, Wq_b and Wo; ``moe_int8`` for experts
        and dense MLP, P087-P088) and 2 in BF16; ``kv_b_proj``, embeddings and LM head in
        BF16. Over ``tp`` ranks each holds the down-projections whole and 1/tp of the rest of
        attention, the dense MLP and the embeddings (a GQA model: 1/tp of the query and
        output projections, and its KV heads' key and value projections,
        :meth:`ModelSpec.gqa_kv_params`). With ``mtp`` (a deployment that drafts)
        the MTP layers too: attention, experts like any MoE layer's, and the BF16 eh_proj
        (the embedding and head are shared)."""
        layers = model.layers + (model.mtp_layers if mtp else 0)
        mla = 1 if self.mla_int8 else 2
        mlp = 1 if self.moe_int8 else 2
        whole = layers * (model.mla_down_params + model.gqa_kv_params(tp)) * mla
        split = (
            layers * ((model.mla_head_params + model.gqa_qo_params) * mla + model.kv_b_params * 2)
            + model.dense_mlp_params * mlp
            + 2 * model.embedding_params
            + 2 * (layers - model.layers) * model.mtp_projection_params
        )
        return whole + split // tp + self.expert_bytes(model, experts, mtp=mtp)

    def expert_bytes(self, model: ModelSpec, experts: int, *, mtp: bool = False) -> int:
        """Bytes of ``experts`` expert instances per MoE layer, over every MoE layer and, with
        ``mtp``, the MTP layers (1 byte per parameter with ``moe_int8``, 2 in BF16)."""
        layers = model.moe_layers + (model.mtp_layers if mtp else 0)
        return experts * layers * model.expert_params * (1 if self.moe_int8 else 2)

    def int8_attention(self, layer: int | None) -> bool:
        """Whether ``layer``'s attention runs in INT8 (None: a layer outside the per-layer
        list, i.e. only the all-layer switch counts)."""
        return self.attention_int8 or (layer is not None and layer in self.attention_int8_layers)


def check_attention(model: ModelSpec, *, field: str = "model") -> None:
    """Refuse a model whose attention the cost model does not price (hybrid linear
    attention), naming the field."""
    if model.attention not in ("mla", "gqa"):
        raise ConfigError(
            f"{model.name}: its {model.attention} attention is not modelled (lightning layers "
            "keep a fixed per-sequence state that neither the kernel costs nor the KV block "
            "accounting cover); xds models MLA (DeepSeek-V3/R1, Kimi K2) and GQA (Qwen3-235B, "
            "GLM-4.5) models",
            field=field,
        )


class Kernel(msgspec.Struct, frozen=True):
    name: str
    flops: float
    bytes: float
    engine: Engine
    time_ns: int


class CostModel:
    """Kernel times of one model on one die."""

    def __init__(
        self,
        model: ModelSpec,
        die: DieSpec,
        *,
        precision: Precision | None = None,
        efficiency: KernelEfficiency | None = None,
    ):
        check_attention(model)
        self.model = model
        self.die = die
        self.precision = precision or Precision()
        self.precision.check_layers(model)
        self.eff = efficiency or KernelEfficiency()

    # -- the primitive ---------------------------------------------------------------------------
    def kernel(
        self, name: str, flops: float, nbytes: float, engine: Engine, *, attention: bool = False
    ) -> Kernel:
        die, eff = self.die, self.eff
        if engine == "vector":
            peak, c_eff = die.vector_flops, eff.vector_compute
        else:
            peak = die.int8_ops if engine == "cube_int8" else die.bf16_flops
            c_eff = eff.attention_compute if attention else eff.gemm_compute
        m_eff = eff.attention_memory if attention else eff.memory
        t = max(flops / (peak * c_eff), nbytes / (die.hbm_bandwidth * m_eff))
        return Kernel(name, flops, nbytes, engine, round(t * 1e9))

    def _gemm(self, name: str, tokens: float, k: int, n: int, int8: bool) -> Kernel:
        """A (tokens x k) @ (k x n) projection: weights read once, BF16 activations."""
        wbytes = k * n * (1 if int8 else 2)
        act = tokens * (k + n) * 2
        return self.kernel(
            name, 2.0 * tokens * k * n, wbytes + act, "cube_int8" if int8 else "cube_bf16"
        )

    # -- attention, whichever the model's family ---------------------------------------------
    def attention_prolog(self, tokens: float, *, absorb: float | None = None) -> list[Kernel]:
        """The kernels before the attention core on ``tokens``: :meth:`mla_prolog` or
        :meth:`gqa_prolog` (``absorb`` is MLA's; GQA has no absorbed form)."""
        if self.model.attention == "mla":
            return self.mla_prolog(tokens, absorb=absorb)
        return self.gqa_prolog(tokens)

    def attention_core(
        self, seqs: int, tokens_per_seq: float, context: int, *, layer: int | None = None
    ) -> Kernel:
        """Decode attention over ``context`` cached tokens: :meth:`mla_attention` or
        :meth:`gqa_attention`."""
        if self.model.attention == "mla":
            return self.mla_attention(seqs, tokens_per_seq, context, layer=layer)
        return self.gqa_attention(seqs, tokens_per_seq, context, layer=layer)

    def attention_output(self, tokens: float, *, absorb: float | None = None) -> list[Kernel]:
        """The kernels after the attention core: :meth:`mla_output` or :meth:`gqa_output`."""
        if self.model.attention == "mla":
            return self.mla_output(tokens, absorb=absorb)
        return self.gqa_output(tokens)

    # -- GQA kernels -------------------------------------------------------------------------
    def gqa_prolog(self, tokens: float, *, tp: int = 1) -> list[Kernel]:
        """GQA before attention: input RMSNorm, the fused q/k/v projection (``heads`` query
        and ``kv_heads`` key and value heads of ``head_dim``) and, with QK-norm, a per-head
        RMSNorm over the queries and keys (RoPE is fused into the attention kernel).

        With ``tp`` > 1, one rank's kernels: it norms its 1/tp of the ``tokens`` (the ranks
        then all-gather the hidden states) and projects every token to its ``heads / tp``
        query heads and its :meth:`~xds.model.ModelSpec.kv_heads_per_rank` KV heads (a KV
        head replicated on several ranks is computed on each)."""
        m = self.model
        q = m.heads // tp * m.head_dim
        kv = m.kv_heads_per_rank(tp) * m.head_dim
        own = tokens / tp
        kernels = [
            self.kernel("rmsnorm", 5.0 * own * m.hidden, 4.0 * own * m.hidden, "vector"),
            self._gemm("qkv_proj", tokens, m.hidden, q + 2 * kv, self.precision.mla_int8),
        ]
        if m.qk_norm:
            kernels.append(
                self.kernel("qk_norm", 5.0 * tokens * (q + kv), 4.0 * tokens * (q + kv), "vector")
            )
        return kernels

    def gqa_attention(
        self, seqs: int, tokens_per_seq: float, context: int, *, layer: int | None = None
    ) -> Kernel:
        """GQA attention over ``context`` cached tokens for ``seqs`` sequences of
        ``tokens_per_seq`` query tokens: each query head scores every cached key and sums the
        values (2 x 2 x head_dim FLOPs per head and cached token); the keys and values are
        read once per sequence, shared by the query heads of a group."""
        m, p = self.model, self.precision
        tokens = seqs * tokens_per_seq
        flops = 4.0 * tokens * m.heads * context * m.head_dim
        kv_bytes = seqs * context * m.kv_bytes_per_token_layer(int8_nope=p.kv_int8_nope)
        engine: Engine = "cube_int8" if p.int8_attention(layer) else "cube_bf16"
        return self.kernel("gqa_attention", flops, kv_bytes, engine, attention=True)

    def gqa_output(self, tokens: float, *, tp: int = 1) -> list[Kernel]:
        """GQA after attention: the output projection (heads x head_dim -> hidden); with
        ``tp`` > 1 one rank's, from its ``heads / tp`` heads (row-parallel: the ranks then
        reduce-scatter the partial sums)."""
        m = self.model
        heads = m.heads // tp
        return [self._gemm("o_proj", tokens, heads * m.head_dim, m.hidden, self.precision.mla_int8)]

    # -- decode kernels ----------------------------------------------------------------------------
    def mla_prolog(self, tokens: float, *, absorb: float | None = None) -> list[Kernel]:
        """The projections before attention on ``tokens``; of them ``absorb`` (default all)
        take the absorbed form's query absorb kernel (prefill's non-absorbed form skips it:
        none is a zero-time kernel)."""
        m, int8 = self.model, self.precision.mla_int8
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        return [
            self.kernel("rmsnorm", 5.0 * tokens * m.hidden, 4.0 * tokens * m.hidden, "vector"),
            self._gemm("q_a_proj", tokens, m.hidden, m.q_lora_rank, int8),
            self._gemm("q_b_proj", tokens, m.q_lora_rank, m.heads * qk, int8),
            self._gemm("kv_a_proj", tokens, m.hidden, m.kv_lora_rank + m.qk_rope_head_dim, int8),
            self._absorb("q_absorb", tokens, m.qk_nope_head_dim, m.kv_lora_rank)
            if absorb is None
            else self.mla_absorbs(absorb)[0],
        ]

    def mla_absorbs(self, tokens: float) -> tuple[Kernel, Kernel]:
        """The absorbed MLA's two per-head kernels on ``tokens``: W_UK into the latent before
        attention, W_UV out of it after (zero-time kernels for no tokens)."""
        m = self.model
        if tokens <= 0:
            none = Kernel("q_absorb", 0.0, 0.0, "cube_bf16", 0)
            return none, msgspec.structs.replace(none, name="v_absorb")
        return (
            self._absorb("q_absorb", tokens, m.qk_nope_head_dim, m.kv_lora_rank),
            self._absorb("v_absorb", tokens, m.kv_lora_rank, m.v_head_dim),
        )

    def _absorb(self, name: str, tokens: float, d_in: int, d_out: int) -> Kernel:
        """A per-head batched projection of the absorbed MLA (W_UK into the latent, or the
        latent out through W_UV): ``heads`` (d_in x d_out) BF16 matrices, activations per head
        (tokens x heads x d_in in, tokens x heads x d_out out)."""
        h = self.model.heads
        weights = h * d_in * d_out * 2
        act = tokens * h * (d_in + d_out) * 2
        return self.kernel(name, 2.0 * tokens * h * d_in * d_out, weights + act, "cube_bf16")

    def kv_up_projection(self, tokens: float, heads: int | None = None) -> Kernel:
        """MLA's ``kv_b_proj`` on ``tokens`` of cached latent: up to ``heads`` heads' no-RoPE
        keys and values (all heads by default; a TP rank computes its own), as the
        non-absorbed form needs for context it attends to; BF16, as SPEC 9.2 leaves it.
        [emulator choice] The GEMM runs in BF16 end to end: its latent input is counted at 2
        bytes even from an INT8 no-RoPE cache, and the K/V it writes stay BF16 for the
        attention kernel even when attention runs INT8. At ~430 FLOPs per byte (4K tokens,
        TP4) it is compute-bound on a die; on few tokens its BF16 weights dominate the bytes."""
        m = self.model
        out = (m.heads if heads is None else heads) * (m.qk_nope_head_dim + m.v_head_dim)
        return self._gemm("kv_b_proj", tokens, m.kv_lora_rank, out, False)

    def mtp_projection(self, tokens: float) -> Kernel:
        """The MTP module's eh_proj: [embedding; hidden] (2H) -> H, BF16 (DeepSeek-V3's MTP
        module; its norms and embedding lookup are negligible)."""
        m = self.model
        return self._gemm("mtp_eh_proj", tokens, 2 * m.hidden, m.hidden, False)

    def mla_attention(
        self, seqs: int, tokens_per_seq: float, context: int, *, layer: int | None = None
    ) -> Kernel:
        """Attention over ``context`` cached tokens for ``seqs`` sequences, each with
        ``tokens_per_seq`` query tokens (1 + MTP drafts), on decoder layer ``layer``."""
        m, p = self.model, self.precision
        tokens = seqs * tokens_per_seq
        latent = m.kv_lora_rank
        flops = (
            2.0 * tokens * m.heads * context * (latent + m.qk_rope_head_dim)
            + 2.0 * tokens * m.heads * context * latent
        )
        kv_bytes = seqs * context * m.kv_bytes_per_token_layer(int8_nope=p.kv_int8_nope)
        engine: Engine = "cube_int8" if p.int8_attention(layer) else "cube_bf16"
        return self.kernel("mla_attention", flops, kv_bytes, engine, attention=True)

    def mla_output(self, tokens: float, *, absorb: float | None = None) -> list[Kernel]:
        """The projections after attention; ``absorb`` as for :meth:`mla_prolog`."""
        m, int8 = self.model, self.precision.mla_int8
        return [
            self._absorb("v_absorb", tokens, m.kv_lora_rank, m.v_head_dim)
            if absorb is None
            else self.mla_absorbs(absorb)[1],
            self._gemm("o_proj", tokens, m.heads * m.v_head_dim, m.hidden, int8),
        ]

    def gating(self, tokens: float) -> Kernel:
        m = self.model
        return self._gemm("gating", tokens, m.hidden, m.routed_experts, False)

    def expert(self, tokens: float, *, name: str = "routed_expert") -> Kernel:
        """One expert's SwiGLU MLP on the ``tokens`` routed to it (INT8 QMM when quantised);
        its weights are read once whatever the token count."""
        m, int8 = self.model, self.precision.moe_int8
        h, i = m.hidden, m.moe_intermediate
        wbytes = 3 * h * i * (1 if int8 else 2) if tokens > 0 else 0
        return self.kernel(
            name,
            2.0 * tokens * 3 * h * i,
            wbytes + tokens * (2 * h + 2 * i) * 2,
            "cube_int8" if int8 else "cube_bf16",
        )

    def dense_mlp(self, tokens: float) -> Kernel:
        m, int8 = self.model, self.precision.moe_int8
        h, i = m.hidden, m.dense_intermediate
        return self.kernel(
            "dense_mlp",
            2.0 * tokens * 3 * h * i,
            3 * h * i * (1 if int8 else 2) + tokens * (2 * h + 2 * i) * 2,
            "cube_int8" if int8 else "cube_bf16",
        )

    def lm_head(self, tokens: float) -> Kernel:
        m = self.model
        return self._gemm("lm_head", tokens, m.hidden, m.vocab, not self.precision.lm_head_bf16)

    def sampling(self, tokens: float) -> Kernel:
        """Greedy sampling: a max over the vocabulary per token (vector, memory-bound)."""
        v = self.model.vocab
        return self.kernel("sampling", 2.0 * tokens * v, 4.0 * tokens * v, "vector")

    def decode_layer(
        self,
        *,
        seqs: int,
        tokens_per_seq: float,
        context: int,
        expert_tokens: list[float] | None = None,
        dense: bool = False,
        layer: int | None = None,
    ) -> list[Kernel]:
        """All compute kernels of one decoder layer on one die (communication excluded).

        ``expert_tokens`` lists the tokens each expert held by this die processes (MoE layers
        under EP); ``dense`` selects the dense MLP instead.
        """
        tokens = seqs * tokens_per_seq
        kernels = [
            *self.attention_prolog(tokens),
            self.attention_core(seqs, tokens_per_seq, context, layer=layer),
            *self.attention_output(tokens),
            self.kernel(
                "post_norm",
                5.0 * tokens * self.model.hidden,
                4.0 * tokens * self.model.hidden,
                "vector",
            ),
        ]
        if dense:
            kernels.append(self.dense_mlp(tokens))
        else:
            kernels.append(self.gating(tokens))
            kernels.extend(self.expert(t) for t in (expert_tokens or []))
        return kernels

    # -- execution modes ---------------------------------------------------------------------------
    def graph_time_ns(self, kernels: list[Kernel]) -> int:
        """Graph mode (decode): kernels back to back after one launch (SPEC 2.1)."""
        return self.eff.graph_launch_ns + sum(k.time_ns for k in kernels)

    def eager_time_ns(self, kernels: list[Kernel]) -> int:
        """Eager mode (prefill): the host dispatches each operator; operator i starts at
        max(device free, its dispatch done) (SPEC 2.1)."""
        device_free = 0
        dispatched = 0
        for k in kernels:
            dispatched += self.eff.eager_op_dispatch_ns
            device_free = max(device_free, dispatched) + k.time_ns
        return device_free


document_fields(KernelEfficiency, Precision)
