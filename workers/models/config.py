"""Model configuration: one frozen, hashable description of an architecture, read from `config.json`.

Each family module turns its Hugging Face config into a `ModelConfig`; the shared helpers here
normalise the key styles of transformers 4.x and 5.x (e.g. `rope_theta` vs `rope_parameters`).
`ModelConfig` is hashable so `jax.jit` can specialise on it as a static argument.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ModelLoadError(ValueError):
    """A checkpoint or config that cannot be served; the message names the offending key or tensor."""


SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


class RopeConfig(BaseModel):
    """RoPE settings, named as transformers names the `rope_parameters` keys; `workers.models.rope` computes them.

    - "linear" divides positions by `factor` (position interpolation).
    - "dynamic" (dynamic NTK) enlarges the base for sequences past `max_position_embeddings` (the model's
      top-level key); this engine fixes the frequencies per program, see `rope.rope_inv_freq`.
    - "yarn" blends interpolated and original frequencies between the dims that turn `beta_fast` and `beta_slow`
      times over `original_max_position_embeddings`, and scales cos/sin by `attention_factor` (or the one
      `mscale`/`mscale_all_dim` give).
    - "llama3" divides the frequencies whose wavelength exceeds `original_max_position_embeddings /
      low_freq_factor` by `factor`, keeps those below `... / high_freq_factor`, and interpolates in between.
    """

    model_config = ConfigDict(frozen=True)

    theta: float = Field(gt=0)
    scaling_type: str = "default"
    factor: float = Field(default=1.0, gt=0)
    # yarn, llama3: the pre-extension context length.
    original_max_position_embeddings: int | None = Field(default=None, gt=0)
    # dynamic: the length past which transformers starts enlarging the base.
    max_position_embeddings: int | None = Field(default=None, gt=0)
    # yarn.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True  # floor/ceil the correction range (transformers 5 default; gpt-oss sets false)
    # llama3.
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    @model_validator(mode="after")
    def _check_type(self) -> "RopeConfig":
        if self.scaling_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type '{self.scaling_type}' (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        needed = {
            "yarn": ("original_max_position_embeddings",),
            "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
            "dynamic": ("max_position_embeddings",),
        }.get(self.scaling_type, ())
        for name in needed:
            if getattr(self, name) is None:
                raise ValueError(f"rope scaling type '{self.scaling_type}' needs {name}")
        return self


class MLAConfig(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds, per token and layer, one row of
    kv_lora_rank latent + qk_rope_head_dim rope key, shared by all heads."""

    model_config = ConfigDict(frozen=True)

    kv_lora_rank: int = Field(gt=0)
    q_lora_rank: int | None = Field(default=None, gt=0)  # None: a plain q_proj
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    rope_interleave: bool = True  # rope dims in (x0, x1) pairs rather than halves
    softmax_scale: float = Field(gt=0)  # qk_head_dim ** -0.5, times YaRN's mscale ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached row: latent | rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class LinearAttentionConfig(BaseModel):
    """Gated DeltaNet layers (Qwen3.5, Qwen3-Next): per-sequence state instead of a growing KV cache.

    Key head j serves value heads j*G .. j*G+G-1 (G = num_value_heads // num_key_heads).
    """

    model_config = ConfigDict(frozen=True)

    num_key_heads: int = Field(gt=0)
    num_value_heads: int = Field(gt=0)
    key_head_dim: int = Field(gt=0)
    value_head_dim: int = Field(gt=0)
    conv_kernel_size: int = Field(gt=1)

    @model_validator(mode="after")
    def _check_heads(self) -> "LinearAttentionConfig":
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of linear_num_key_heads ({self.num_key_heads})"
            )
        return self

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q | k | v."""
        return 2 * self.key_dim + self.value_dim


class Gemma4Settings(BaseModel):
    """What only Gemma 4's forward needs (`gemma4.py`); the per-layer attention shapes and KV sharing the
    engine must know are ModelConfig fields."""

    model_config = ConfigDict(frozen=True)

    # Full-attention layers: "proportional" RoPE (theta, the rotated fraction of the head, factor).
    full_rope_theta: float = Field(gt=0)
    full_partial_rotary_factor: float = Field(gt=0, le=1)
    full_rope_factor: float = Field(default=1.0, gt=0)
    # Full layers without v_proj: V is v_norm(k_proj x), K is RoPE(k_norm(k_proj x)).
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = Field(default=None, gt=0)
    # Per-layer input embeddings (0: none).
    hidden_size_per_layer_input: int = Field(default=0, ge=0)
    vocab_size_per_layer_input: int = Field(default=0, ge=0)
    # Per layer: the dense MLP's width (KV-shared layers of `use_double_wide_mlp` models are twice as wide).
    layer_intermediate_sizes: tuple[int, ...]


class ModelConfig(BaseModel):
    """Everything the forward pass needs to know about an architecture, nothing about serving."""

    model_config = ConfigDict(frozen=True)

    model_type: str
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope: RopeConfig
    tie_word_embeddings: bool = False
    # Attention variants.
    qk_norm: bool = False
    qkv_bias: bool = False
    # Per layer: None for full attention, else the window size (a query sees `window` keys incl. itself).
    sliding_windows: tuple[int | None, ...]
    # MLP: per layer, True when the layer is MoE.
    moe_layers: tuple[bool, ...]
    intermediate_size: int = Field(default=0, ge=0)  # dense SwiGLU layers
    num_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(default=0, ge=0)
    moe_intermediate_size: int = Field(default=0, ge=0)
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    max_position_embeddings: int = Field(default=4096, gt=0)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid models (Qwen3.5, Qwen3-Next): these layer ids are Gated DeltaNet, the rest full attention.
    linear_attention_layers: tuple[int, ...] = ()
    linear: LinearAttentionConfig | None = None
    # q_proj yields per head [query | gate]; the attention output is multiplied by sigmoid(gate).
    attn_output_gate: bool = False
    # RoPE rotates the first head_dim * factor dims of each head (rotate-half); the rest pass through.
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1)
    # RMSNorm weights are offsets from one: norm(x) * (1 + w) (input, post-attention, final, q/k norms).
    zero_centered_norm: bool = False
    # DeepSeek-V3: multi-head latent attention, and a sigmoid router choosing within the best expert groups.
    mla: MLAConfig | None = None
    num_expert_groups: int = Field(default=1, gt=0)
    topk_expert_groups: int = Field(default=1, gt=0)
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    # The routed experts' activation (their SwiGLU's gate): "silu", or Gemma 4's "gelu_tanh".
    expert_activation: str = "silu"
    # Attention shapes per layer where they differ (Gemma 4: full layers have other head dims and KV heads);
    # empty: `head_dim` / `num_kv_heads` everywhere.
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    # Per layer, the layer whose KV cache it attends: itself, or an earlier layer of the same kind whose
    # KV it reuses and to which it writes nothing (Gemma 4's `num_kv_shared_layers`). Empty: itself.
    kv_source_layers: tuple[int, ...] = ()
    gemma4: Gemma4Settings | None = None

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})")
        if len(self.moe_layers) != self.num_layers or len(self.sliding_windows) != self.num_layers:
            raise ValueError("per-layer settings must have num_hidden_layers entries")
        if any(self.moe_layers):
            if not (0 < self.num_experts_per_tok <= self.num_experts):
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ValueError("moe_intermediate_size must be positive for MoE layers")
            if self.num_experts % self.num_expert_groups or self.topk_expert_groups > self.num_expert_groups:
                raise ValueError(
                    f"n_group ({self.num_expert_groups}) must divide the {self.num_experts} experts and topk_group "
                    f"({self.topk_expert_groups}) must not exceed it"
                )
        if not all(self.moe_layers) and self.intermediate_size <= 0:
            raise ValueError("intermediate_size must be positive for dense MLP layers")
        if self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor ({self.partial_rotary_factor}) of head_dim ({self.head_dim}) must give an "
                "even number of rotary dims"
            )
        for name in ("layer_head_dims", "layer_kv_heads", "kv_source_layers"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{name} must have num_hidden_layers entries")
        if any(self.num_heads % self.layer_num_kv_heads(i) for i in range(self.num_layers)):
            raise ValueError(f"every layer's KV heads must divide num_attention_heads ({self.num_heads})")
        for layer, source in enumerate(self.kv_source_layers):
            if source > layer or self.kv_source_layers[source] != source or self.sliding_windows[source] != self.sliding_windows[layer]:
                raise ValueError(f"layer {layer} cannot reuse the KV of layer {source} (an earlier layer of its kind that keeps its own)")
        if self.linear_attention_layers:
            ids = self.linear_attention_layers
            if list(ids) != sorted(set(ids)) or not all(0 <= i < self.num_layers for i in ids):
                raise ValueError(f"linear attention layers {ids} must be distinct, sorted ids < num_hidden_layers")
            if self.linear is None:
                raise ValueError("linear attention layers need the linear_* settings")
        return self

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def layer_num_kv_heads(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    @property
    def kv_page_dims(self) -> tuple[int, int]:
        """The last two dims of a KV page [num_pages, page_size, *kv_page_dims]: K and V per KV head
        interleaved (2 * Hkv, D), or MLA's one latent row per token (1, kv_lora_rank + rope dim). Models
        whose layers differ (`uniform_kv_pages` false) have one per cache layer: `kv_layer_page_dims`."""
        if not self.uniform_kv_pages:
            raise ValueError(f"{self.model_type}: the KV page shape differs per layer (see kv_layer_page_dims)")
        return self.kv_layer_page_dims(0) if self.num_kv_layers else (2 * self.num_kv_heads, self.head_dim)

    def kv_layer_page_dims(self, kv_layer: int) -> tuple[int, int]:
        """The page dims of cache layer `kv_layer` (an index among `kv_layer_ids`)."""
        if self.mla is not None:
            return (1, self.mla.latent_dim)
        layer = self.kv_layer_ids[kv_layer]
        return (2 * self.layer_num_kv_heads(layer), self.layer_head_dim(layer))

    @property
    def kv_transport_dims(self) -> tuple[int, int]:
        """How one block of one cache layer leaves the device (handoff chunks, the host tier): its page dims
        when every layer shares them; else one row per token as wide as the widest layer's 2 * Hkv * D,
        each layer zero-padded to it (Gemma 4's full layers are half as wide as its sliding ones)."""
        if self.uniform_kv_pages:
            return self.kv_page_dims
        return (1, max(math.prod(self.kv_layer_page_dims(i)) for i in range(self.num_kv_layers)))

    @property
    def uniform_kv_pages(self) -> bool:
        return len({self.kv_layer_page_dims(i) for i in range(self.num_kv_layers)}) <= 1

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of KV cached per token over all layers (times the dtype's size: bytes)."""
        return sum(math.prod(self.kv_layer_page_dims(i)) for i in range(self.num_kv_layers))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    # Layer bookkeeping for hybrid models. The KV cache holds one entry per full-attention layer and
    # the state cache one per linear-attention layer, each indexed in layer order; for attention-only
    # models kv_layer_index(l) == l.

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_attention_layers)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        linear = set(self.linear_attention_layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """The attention layers that keep a KV cache (not the linear ones, not those reusing another's)."""
        return tuple(i for i in self.attention_layer_ids if self.kv_source_layer(i) == i)

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layer_ids)

    @property
    def num_state_layers(self) -> int:
        return len(self.linear_attention_layers)

    def is_linear_layer(self, layer: int) -> bool:
        return layer in self.linear_attention_layers

    def kv_source_layer(self, layer: int) -> int:
        return self.kv_source_layers[layer] if self.kv_source_layers else layer

    def kv_layer_index(self, layer: int) -> int:
        """Index among the cache layers of the KV attention layer `layer` reads (its own, or the one it reuses)."""
        if self.is_linear_layer(layer):
            raise ValueError(f"layer {layer} is a linear-attention layer; it has no KV cache")
        return self.kv_layer_ids.index(self.kv_source_layer(layer))

    def state_layer_index(self, layer: int) -> int:
        """Index of linear-attention layer `layer` among the linear-attention layers."""
        if not self.is_linear_layer(layer):
            raise ValueError(f"layer {layer} is a full-attention layer; it has no linear-attention state")
        return self.linear_attention_layers.index(layer)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """Per sequence and linear layer: the last K-1 conv inputs, [K-1, conv_dim]."""
        return (self.linear.conv_kernel_size - 1, self.linear.conv_dim)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """Per sequence and linear layer: one [dk, dv] state per value head."""
        return (self.linear.num_value_heads, self.linear.key_head_dim, self.linear.value_head_dim)


# ---------------------------------------------------------------------------------------------
# Helpers shared by the family readers.


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"missing config.json in {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"config.json is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json must hold a JSON object")
    return raw


def require(raw: dict[str, Any], key: str, *aliases: str) -> Any:
    for k in (key, *aliases):
        if k in raw and raw[k] is not None:
            return raw[k]
    raise ModelLoadError(f"config.json: missing required key '{key}'")


def rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    """Reads RoPE settings from either key style.

    transformers 5.x: `rope_parameters: {rope_type, rope_theta, factor, ...}`;
    4.x: `rope_theta` plus an optional `rope_scaling: {type|rope_type, factor, ...}`. The scaling keys are
    transformers' (`original_max_position_embeddings`, `beta_fast`, `low_freq_factor`, ...), with its fallbacks:
    a top-level `original_max_position_embeddings` overrides the dict's, and both default to the top-level
    `max_position_embeddings`; a yarn `factor` of null means `max_position_embeddings / original_max_position_embeddings`;
    unset yarn betas are 32 and 1. `dynamic` takes `max_position_embeddings` from the top level.
    """
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and "rope_theta" not in params:
        params = params["full_attention"]  # per-attention-type layout of some v5 configs
    scaling = raw.get("rope_scaling")
    where = "rope_scaling"
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling, where = params, "rope_parameters"
    else:
        theta = raw.get("rope_theta", 10000.0)
    if scaling is None:
        scaling = {}
    elif not isinstance(scaling, dict):
        raise ModelLoadError(f"config.json: rope_scaling must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"config.json: unsupported rope scaling type '{rope_type}' (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"config.json: {where}.{key} must be a number, got {value!r}")
        return float(value)

    def required(key: str) -> float:
        if scaling.get(key) is None:
            raise ModelLoadError(f"config.json: rope scaling type '{rope_type}' needs '{key}' in {where}")
        return number(key, scaling[key])

    def optional(key: str) -> float | None:
        return None if scaling.get(key) is None else number(key, scaling[key])

    def top_level_int(key: str) -> int:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelLoadError(f"config.json: rope scaling type '{rope_type}' needs an integer '{key}', got {value!r}")
        return value

    fields: dict[str, Any] = dict(theta=theta, scaling_type=rope_type)
    if rope_type in ("default", "linear"):
        fields["factor"] = number("factor", scaling.get("factor", 1.0) or 1.0)
    elif rope_type == "dynamic":
        fields.update(factor=required("factor"), max_position_embeddings=top_level_int("max_position_embeddings"))
    else:  # yarn, llama3: the pre-extension length; transformers lets a top-level key win over the dict's
        for source in (raw, scaling):
            if source.get("original_max_position_embeddings") is not None:
                original = source["original_max_position_embeddings"]
                if isinstance(original, bool) or not isinstance(original, int):
                    raise ModelLoadError(f"config.json: original_max_position_embeddings must be an integer, got {original!r}")
                break
        else:
            if raw.get("max_position_embeddings") is None:
                raise ModelLoadError(f"config.json: rope scaling type '{rope_type}' needs 'original_max_position_embeddings' in {where}")
            original = top_level_int("max_position_embeddings")
        fields["original_max_position_embeddings"] = original
        if rope_type == "yarn":
            if "factor" not in scaling:
                raise ModelLoadError(f"config.json: rope scaling type 'yarn' needs 'factor' in {where}")
            factor = optional("factor")
            if factor is None:  # DeepSeek-style: the ratio of the extended to the original length
                factor = top_level_int("max_position_embeddings") / original
            fields.update(
                factor=factor,
                beta_fast=optional("beta_fast") or 32.0,  # transformers: `or`, so 0 also means the default
                beta_slow=optional("beta_slow") or 1.0,
                mscale=optional("mscale"),
                mscale_all_dim=optional("mscale_all_dim"),
                attention_factor=optional("attention_factor"),
                truncate=bool(scaling.get("truncate", True)),
            )
        else:
            fields.update(
                factor=required("factor"), low_freq_factor=required("low_freq_factor"), high_freq_factor=required("high_freq_factor")
            )
    try:
        return RopeConfig(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "rope"
        key = {"theta": "rope_theta", "scaling_type": "rope_type"}.get(field, field)
        raise ModelLoadError(f"config.json: invalid {where}.{key}: {first['msg']}") from None


def eos_ids_from_hf(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def build_config(**fields: Any) -> ModelConfig:
    """Validates the normalised fields, turning pydantic errors into one-line load errors."""
    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise ModelLoadError(f"config.json: invalid {where}: {first['msg']}") from None


def common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields every decoder-only family spells the same way in `config.json`."""
    hidden = int(require(raw, "hidden_size"))
    heads = int(require(raw, "num_attention_heads"))
    return dict(
        model_type=raw["model_type"],
        vocab_size=require(raw, "vocab_size"),
        hidden_size=hidden,
        num_layers=require(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope=rope_from_hf(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids_from_hf(raw),
    )


def sparse_moe_layers(raw: dict[str, Any], num_experts: int) -> tuple[bool, ...]:
    """Qwen rule: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    n = int(require(raw, "num_hidden_layers"))
    step = raw.get("decoder_sparse_step", 1) or 1
    if not isinstance(step, int) or step < 1:
        raise ModelLoadError(f"config.json: decoder_sparse_step must be a positive integer, got {step!r}")
    mlp_only = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(n))


def windows_from_layer_types(raw: dict[str, Any], default: list[str]) -> tuple[int | None, ...]:
    """Per-layer sliding window from `layer_types` ("sliding_attention" | "full_attention")."""
    types = raw.get("layer_types") or default
    window = raw.get("sliding_window") or None
    if len(types) != int(require(raw, "num_hidden_layers")):
        raise ModelLoadError("config.json: layer_types must have num_hidden_layers entries")
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            raise ModelLoadError(f"config.json: unsupported layer type '{t}' in layer_types")
    return tuple(window if t == "sliding_attention" and window else None for t in types)


# ---------------------------------------------------------------------------------------------
# Hybrid linear-attention models (Qwen3.5, Qwen3-Next).

LAYER_TYPES = ("linear_attention", "full_attention")


def text_config_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys of a vision-language composite (`text_config`), top-level keys as fallback.

    `model_type` stays the composite's (the family and the checkpoint layout follow it). Tied embeddings
    follow the composite's own `tie_word_embeddings` (what its ForConditionalGeneration class does).
    """
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(
            f"config.json: missing required key 'text_config' ({raw.get('model_type')} without a text model cannot be served)"
        )
    outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**outer, **text, "model_type": raw["model_type"], "tie_word_embeddings": tie}


def hybrid_layers_from_hf(raw: dict[str, Any]) -> tuple[int, ...]:
    """Ids of the Gated DeltaNet layers, from `layer_types` or else every `full_attention_interval`-th
    layer (default 4) being full attention."""
    n = int(require(raw, "num_hidden_layers"))
    types = raw.get("layer_types")
    if types is None:
        interval = raw.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ModelLoadError(f"config.json: full_attention_interval must be a positive integer, got {interval!r}")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise ModelLoadError("config.json: layer_types must have num_hidden_layers entries")
    for t in types:
        if t not in LAYER_TYPES:
            raise ModelLoadError(f"config.json: unsupported layer type '{t}' in layer_types (supported: {', '.join(LAYER_TYPES)})")
    return tuple(i for i, t in enumerate(types) if t == "linear_attention")


def hybrid_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields Qwen3.5 and Qwen3-Next share: layer kinds, Gated DeltaNet sizes, gated
    attention with q/k norm and partial rotary, zero-centred RMSNorm."""
    linear_layers = hybrid_layers_from_hf(raw)
    linear = None
    if linear_layers:
        linear = dict(
            num_key_heads=require(raw, "linear_num_key_heads"),
            num_value_heads=require(raw, "linear_num_value_heads"),
            key_head_dim=require(raw, "linear_key_head_dim"),
            value_head_dim=require(raw, "linear_value_head_dim"),
            conv_kernel_size=require(raw, "linear_conv_kernel_dim"),
        )
    # transformers keeps partial_rotary_factor in rope_parameters (older configs: top level); 0.25 when absent.
    # Text-only mRoPE (`mrope_section`) gives every section the same position: plain RoPE.
    params = raw.get("rope_parameters")
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = factor if factor is not None else raw.get("partial_rotary_factor", 0.25)
    if raw.get("attention_bias"):  # q/k/v and o_proj biases: no released checkpoint has them
        raise ModelLoadError("config.json: attention_bias true is not supported for this model type")
    n = int(require(raw, "num_hidden_layers"))
    return dict(
        linear_attention_layers=linear_layers,
        linear=linear,
        attn_output_gate=True,
        partial_rotary_factor=factor,
        zero_centered_norm=True,
        qk_norm=True,
        sliding_windows=(None,) * n,
    )
