"""Specs of the models xDeepServe serves, from their published configs (REFERENCE.md 2).

Sources (full references in REFERENCE.md): CFG-DSV3 = deepseek-ai/DeepSeek-V3
``inference/configs/config_671B.json`` and HF ``config.json``; CFG-K2 = Kimi-K2-Instruct config
(aiconfigurator copy) and MoonshotAI/Kimi-K2 README; CFG-QW = Qwen3-235B-A22B config (MindSpeed-RL
yaml); CFG-GLM = GLM-4.5 (NeMo Megatron-Bridge docs, slime script); CFG-MM = MiniMax-M1 HF
config.json.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..config import check_fields
from ..docfields import document_fields
from ..errors import ConfigError

Attention = Literal["mla", "gqa", "lightning+gqa"]


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    source: str
    layers: int
    dense_layers: int
    """Leading layers with a dense MLP instead of MoE."""
    hidden: int
    attention: Attention
    heads: int
    kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_layers: int = 0
    """For hybrid attention: how many layers use softmax (GQA) attention."""
    qk_norm: bool = False
    """GQA: an RMSNorm over each query and key head before RoPE (Qwen3, GLM-4.5)."""
    routed_experts: int
    top_k: int
    shared_experts: int
    moe_intermediate: int
    dense_intermediate: int
    vocab: int
    mtp_layers: int = 0
    max_context_tokens: int = 0
    """The longest sequence (prompt + output) the model serves; 0: not said (no check)."""

    def __post_init__(self) -> None:
        check_fields(self)
        positive = ["layers", "hidden", "heads", "routed_experts", "top_k", "vocab"]
        positive += ["moe_intermediate"]
        if self.attention == "mla":
            positive += ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"]
            positive += ["v_head_dim"]
        else:
            positive += ["kv_heads", "head_dim"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"{self.name}: must be >= 1 for {self.attention} attention, got "
                    f"{getattr(self, name)}",
                    field=name,
                )
        checks = [
            ("dense_layers", 0 <= self.dense_layers < self.layers, f"in 0..{self.layers - 1}"),
            ("top_k", self.top_k <= self.routed_experts, f"<= {self.routed_experts} (routed)"),
            ("shared_experts", self.shared_experts >= 0, ">= 0"),
            ("mtp_layers", self.mtp_layers >= 0, ">= 0"),
            ("dense_intermediate", self.dense_intermediate >= (1 if self.dense_layers else 0),
             ">= 1 with dense layers"),
        ]  # fmt: skip
        if self.attention != "mla":
            mla_set = [
                f
                for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
                if getattr(self, f)
            ]
            checks += [
                (
                    "kv_heads",
                    self.heads % self.kv_heads == 0,
                    f"a divisor of heads ({self.heads}): each KV head serves a group of query "
                    "heads",
                ),
                (
                    mla_set[0] if mla_set else "attention",
                    not mla_set,
                    f"0: an MLA dimension on a {self.attention} model (or set attention = 'mla')",
                ),
            ]
        if self.attention == "lightning+gqa":
            checks.append(
                ("softmax_layers", 1 <= self.softmax_layers <= self.layers, f"in 1..{self.layers}")
            )
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(
                    f"{self.name}: must be {rule}, got {getattr(self, name, None)!r}", field=name
                )

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def kv_cached_layers(self) -> int:
        return self.softmax_layers if self.attention == "lightning+gqa" else self.layers

    def kv_bytes_per_token_layer(self, *, int8_nope: bool = False) -> int:
        """KV-cache bytes per token per cached layer.

        MLA caches the 512-dim latent plus the 64-dim RoPE key (P090); with ``int8_nope`` the
        non-RoPE latent is INT8 and the RoPE part stays BF16 (SPEC 9.2). GQA caches K and V per
        KV head in BF16.
        """
        if self.attention == "mla":
            nope = self.kv_lora_rank * (1 if int8_nope else 2)
            return nope + self.qk_rope_head_dim * 2
        kv = 2 * self.kv_heads * self.head_dim
        return kv * (1 if int8_nope else 2)

    def kv_bytes_per_token(self, *, int8_nope: bool = False, mtp: bool = False) -> int:
        """KV-cache bytes per token over all cached layers; with ``mtp`` also the MTP
        layers' (a deployment that drafts keeps their cache too: the MTP layer attends over
        every earlier position, so prefill computes it and it moves with the rest)."""
        layers = self.kv_cached_layers + (self.mtp_layers if mtp else 0)
        return self.kv_bytes_per_token_layer(int8_nope=int8_nope) * layers

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden * self.moe_intermediate

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """GQA: the KV heads one of ``tp`` attention ranks holds (a rank needs at least one:
        with more ranks than KV heads each head is replicated on ``tp / kv_heads`` ranks)."""
        return -(-self.kv_heads // tp)

    def kv_rank_share(self, tp: int = 1) -> float:
        """The share of a token's KV cache one of ``tp`` attention ranks holds: MLA's latent
        is replicated on every rank (1.0); GQA splits the KV heads
        (:meth:`kv_heads_per_rank` of ``kv_heads``)."""
        if self.attention == "mla":
            return 1.0
        return self.kv_heads_per_rank(tp) / self.kv_heads

    @property
    def mla_down_params(self) -> int:
        """MLA's down-projections of one layer, Wq_a and Wkv_a (hidden -> q LoRA rank, and ->
        KV LoRA rank + RoPE key): every TP rank holds them whole (it projects its own tokens
        down, then the ranks all-gather the latents). 0 for a model without MLA."""
        if self.attention != "mla":
            return 0
        return self.hidden * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def mla_head_params(self) -> int:
        """MLA's per-head projections of one layer, Wq_b and Wo, split over TP ranks by head
        (INT8-quantised with Wq_a and Wkv_a, SPEC 9.2). 0 for a model without MLA."""
        if self.attention != "mla":
            return 0
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.q_lora_rank * self.heads * qk + self.heads * self.v_head_dim * self.hidden

    @property
    def kv_b_params(self) -> int:
        """MLA's ``kv_b_proj`` of one layer (W_UK and W_UV: latent -> each head's no-RoPE key
        and value), split by head. The absorbed form folds it into its per-head kernels,
        prefill's non-absorbed form up-projects the latent with it; SPEC 9.2 does not
        quantise it, so it stays BF16 (16.8M of DeepSeek-V3's 187M per layer). 0 for a model
        without MLA."""
        if self.attention != "mla":
            return 0
        return self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def gqa_qo_params(self) -> int:
        """GQA's query and output projections of one layer (hidden -> heads x head_dim and
        back), split over TP ranks by head. 0 for an MLA model."""
        if self.attention == "mla":
            return 0
        return 2 * self.hidden * self.heads * self.head_dim

    def gqa_kv_params(self, tp: int = 1) -> int:
        """GQA's key and value projections one of ``tp`` attention ranks holds for one layer
        (its :meth:`kv_heads_per_rank` heads). 0 for an MLA model."""
        if self.attention == "mla":
            return 0
        return 2 * self.hidden * self.kv_heads_per_rank(tp) * self.head_dim

    @property
    def attention_layer_params(self) -> int:
        """Attention projection parameters of one layer: MLA's Wq_a, Wkv_a, Wq_b, Wo and
        ``kv_b_proj``; GQA's q, k, v and o projections."""
        return (
            self.mla_down_params
            + self.mla_head_params
            + self.kv_b_params
            + self.gqa_qo_params
            + self.gqa_kv_params()
        )

    @property
    def attention_params(self) -> int:
        """Attention projection parameters of all decoder layers (:attr:`attention_layer_params`
        each)."""
        return self.layers * self.attention_layer_params

    @property
    def total_params(self) -> int:
        """Parameters of the main model (MTP layers excluded): attention projections, dense
        MLPs, every routed and shared expert of the MoE layers, embedding and LM head (what
        the attention family's projections count: :attr:`attention_layer_params`; a hybrid
        model's linear-attention layers are counted as its GQA layers, which undercounts
        them)."""
        experts = self.routed_experts + self.shared_experts
        return self._params(experts)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: as :attr:`total_params` with ``top_k``
        routed experts and the shared ones per MoE layer."""
        return self._params(self.top_k + self.shared_experts)

    def _params(self, experts_per_layer: int) -> int:
        return (
            self.attention_params
            + self.dense_mlp_params
            + self.moe_layers * experts_per_layer * self.expert_params
            + self.embedding_params
        )

    @property
    def mtp_projection_params(self) -> int:
        """The MTP module's own projection per MTP layer (eh_proj: [embedding; hidden] -> hidden;
        it shares the embedding and LM head with the main model)."""
        return 2 * self.hidden * self.hidden

    @property
    def dense_mlp_params(self) -> int:
        """Parameters of the dense (non-MoE) MLP layers."""
        return self.dense_layers * 3 * self.hidden * self.dense_intermediate

    @property
    def embedding_params(self) -> int:
        """Input embedding and LM head."""
        return 2 * self.vocab * self.hidden


DEEPSEEK_V3 = ModelSpec(
    name="DeepSeek-V3/R1",
    source="CFG-DSV3",
    layers=61,
    dense_layers=3,
    hidden=7168,
    attention="mla",
    heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    routed_experts=256,
    top_k=8,
    shared_experts=1,
    moe_intermediate=2048,
    dense_intermediate=18432,
    vocab=129_280,
    mtp_layers=1,
    max_context_tokens=163_840,  # YaRN x40 of 4K (REFERENCE section 2)
)
KIMI_K2 = ModelSpec(
    name="Kimi K2",
    source="CFG-K2",
    layers=61,
    dense_layers=1,
    hidden=7168,
    attention="mla",
    heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    routed_experts=384,
    top_k=8,
    shared_experts=1,
    moe_intermediate=2048,
    dense_intermediate=18432,
    vocab=163_840,
    mtp_layers=0,
    max_context_tokens=131_072,  # K2-Instruct
)
QWEN3_235B = ModelSpec(
    name="Qwen3-235B-A22B",
    source="CFG-QW",
    layers=94,
    dense_layers=0,
    hidden=4096,
    attention="gqa",
    heads=64,
    kv_heads=4,
    head_dim=128,
    qk_norm=True,
    routed_experts=128,
    top_k=8,
    shared_experts=0,
    moe_intermediate=1536,
    dense_intermediate=12288,
    vocab=151_936,
    max_context_tokens=131_072,  # YaRN-extended, as served for long prompts; 40,960 native
)
GLM_45 = ModelSpec(
    name="GLM-4.5",
    source="CFG-GLM",
    layers=92,
    dense_layers=3,
    hidden=5120,
    attention="gqa",
    heads=96,
    kv_heads=8,
    head_dim=128,
    qk_norm=True,
    routed_experts=160,
    top_k=8,
    shared_experts=1,
    moe_intermediate=1536,
    dense_intermediate=12288,
    vocab=151_552,
    mtp_layers=1,
    max_context_tokens=131_072,  # CFG-GLM
)
MINIMAX_M1 = ModelSpec(
    name="MiniMax-M1",
    source="CFG-MM",
    layers=80,
    dense_layers=0,
    hidden=6144,
    attention="lightning+gqa",
    heads=64,
    kv_heads=8,
    head_dim=128,
    softmax_layers=10,
    routed_experts=32,
    top_k=2,
    shared_experts=0,
    moe_intermediate=9216,
    dense_intermediate=0,
    vocab=200_064,
    max_context_tokens=10_240_000,  # its config
)


def check_context(model: ModelSpec, input_tokens: int, output_tokens: int) -> None:
    """A fixed-length sequence fits the model's context (ConfigError naming the longer of
    input_tokens and output_tokens)."""
    total = input_tokens + output_tokens
    if model.max_context_tokens and total > model.max_context_tokens:
        raise ConfigError(
            f"input_tokens + output_tokens = {total:,} exceed {model.name}'s context of "
            f"{model.max_context_tokens:,} tokens",
            field="output_tokens" if output_tokens > input_tokens else "input_tokens",
        )


MODELS: dict[str, ModelSpec] = {
    "deepseek-v3": DEEPSEEK_V3,
    "deepseek-r1": DEEPSEEK_V3,
    "kimi-k2": KIMI_K2,
    "qwen3-235b": QWEN3_235B,
    "glm-4.5": GLM_45,
    "minimax-m1": MINIMAX_M1,
}


document_fields(ModelSpec)
