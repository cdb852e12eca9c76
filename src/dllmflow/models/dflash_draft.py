"""Our DFlash draft model (docs/strategies.md §2.5 "Reference draft semantics"), for drafts with no transformers class.

The draft has no token embedding and no LM head: block tokens are embedded by the frozen target's
embedding and read out by the frozen target's head. What it owns:

    ctx   = hidden_norm(fc(concat of the chosen target layers' hidden states))    # [B, S, d]
    layer: keys/values = [k/v_proj(ctx); k/v_proj(norm(x))], queries = q_proj(norm(x)) from the
           block tokens only, non-causal, RoPE with the given position ids (ctx ++ block positions),
           the caller's attention mask (dense additive for sdpa, a flex `BlockMask` for flex_attention)
    out   = norm(x)                                                                # [B, N·bs, d]

Parameter names follow the published DFlash drafts (`fc`, `hidden_norm`, `layers.i.self_attn.q_proj`,
..., `norm`), so a `z-lab/*-DFlash-*` checkpoint loads into this class without remote code.
`DFlashDraftConfig` / `DFlashDraftModel` register with `AutoConfig` / `AutoModel` on import:

    from dllmflow.models.dflash_draft import build_draft_config, DFlashDraftModel, load_draft
    draft = DFlashDraftModel(build_draft_config(target.config, num_draft_layers=1, block_size=8))
    draft.save_pretrained(d); load_draft(d)       # or AutoModel.from_pretrained(d)
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, PreTrainedModel, Qwen3Config
from transformers import initialization as init
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dllmflow.errors import UserError
from dllmflow.models.meta import pretrained_kwargs
from dllmflow.models.shipped_configs import config_dict


class DFlashDraftConfig(Qwen3Config):
    """A Qwen3-shaped layer stack plus the DFlash fields (all saved in config.json)."""

    model_type = "dflash_draft"

    block_size: int = 16
    num_target_layers: int = 36
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    target_model_id: str | None = None
    # The mask id has no row in the target embedding (a tokenizer that gained <|MASK|>): the draft
    # learns its own mask embedding instead of resizing the frozen target.
    own_mask_embedding: bool = False


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers feeding the draft, evenly spaced from 1 to n-3 (docs/strategies.md §2.5): m=1 -> [n//2],
    else round(1 + i·(n-4)/(m-1)). (12, 3) -> [1, 5, 9]; (36, 5) -> [1, 9, 17, 25, 33]."""
    n, m = num_target_layers, num_draft_layers
    if m == 1:
        return [n // 2]
    return [round(1 + i * (n - 4) / (m - 1)) for i in range(m)]


def build_draft_config(
    target_config,
    num_draft_layers: int,
    block_size: int,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    target_model_id: str | None = None,
    own_mask_embedding: bool = False,
) -> DFlashDraftConfig:
    """A draft shaped like the target's layers (hidden size, heads, MLP, RoPE) with fewer layers."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    n_target = tc.num_hidden_layers
    ids = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(n_target, num_draft_layers)
    heads = tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    return DFlashDraftConfig(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        hidden_act=getattr(tc, "hidden_act", "silu"),
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters=dict(rope),
        attention_bias=bool(getattr(tc, "attention_bias", False)),
        use_cache=False,
        block_size=block_size,
        num_target_layers=n_target,
        target_layer_ids=ids,
        mask_token_id=mask_token_id,
        target_model_id=target_model_id,
        own_mask_embedding=own_mask_embedding,
    )


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DFlashAttention(nn.Module):
    """Queries from the block tokens, keys/values from [context; block tokens], no causal mask."""

    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, attention_mask) -> Tensor:
        bsz, q_len, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)  # [B, S+Q, d]
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, -1, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(bsz, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # RoPE: keys take every position (ctx ++ block), queries the trailing block positions.
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, S+Q, hd]
        k = k * cos + _rotate_half(k) * sin
        q = q * cos[:, :, -q_len:] + _rotate_half(q) * sin[:, :, -q_len:]
        out = _attend(q, k, v, attention_mask)  # [B, H, Q, hd]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


def _attend(q: Tensor, k: Tensor, v: Tensor, attention_mask) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if attention_mask is not None and not isinstance(attention_mask, Tensor):  # a flex BlockMask
        flex = _compiled_flex_attention() if q.is_cuda else _eager_flex_attention()
        return flex(q, k, v, block_mask=attention_mask, enable_gqa=gqa)
    if attention_mask is not None:
        attention_mask = attention_mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False, enable_gqa=gqa)


def _eager_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@functools.cache
def _compiled_flex_attention():
    # Uncompiled flex materialises the full score matrix; compiled it is the sparse fused kernel.
    return torch.compile(_eager_flex_attention(), dynamic=False)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, attention_mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash draft: `forward(target_hidden, noise_embedding, position_ids, attention_mask)` ->
    block hidden states [B, N·bs, d] (final norm applied; logits come from the target's head)."""

    config_class = DFlashDraftConfig
    config: DFlashDraftConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True

    def __init__(self, config: DFlashDraftConfig):
        super().__init__(config)
        ids = config.target_layer_ids or build_target_layer_ids(
            config.num_target_layers, config.num_hidden_layers
        )
        self.target_layer_ids = list(ids)
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        d = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if config.own_mask_embedding:
            self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self and getattr(self, "mask_embedding", None) is not None:
            init.normal_(self.mask_embedding, mean=0.0, std=self.config.initializer_range)

    def forward(
        self,
        target_hidden: Tensor,
        noise_embedding: Tensor,
        position_ids: Tensor,
        attention_mask=None,
        mask_positions: Tensor | None = None,
        use_cache: bool = False,
        is_causal: bool = False,
        **kwargs,
    ) -> Tensor:
        """target_hidden [B, S, |ids|·d]; noise_embedding [B, Q, d]; position_ids [B, S+Q];
        attention_mask [B, 1, Q, S+Q] additive, a BlockMask, or None (sees everything: only for
        inference where the context is exactly the prefix); mask_positions [B, Q] bool: block
        slots holding the mask token (used only with `own_mask_embedding`)."""
        x = noise_embedding.to(self.fc.weight.dtype)  # [B, Q, d]
        if mask_positions is not None and getattr(self, "mask_embedding", None) is not None:
            x = torch.where(mask_positions[..., None], self.mask_embedding.to(x.dtype), x)
        ctx = self.hidden_norm(self.fc(target_hidden.to(x.dtype)))  # [B, S, d]
        cos, sin = self.rotary_emb(x, position_ids)  # [B, S+Q, hd] each
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask)
        return self.norm(x)  # [B, Q, d]


AutoConfig.register(DFlashDraftConfig.model_type, DFlashDraftConfig, exist_ok=True)
AutoModel.register(DFlashDraftConfig, DFlashDraftModel, exist_ok=True)


# ---- loading a draft checkpoint -------------------------------------------------------------------


def read_draft_config_dict(path: str | Path) -> dict:
    """The raw config.json of a draft (a local dir or a hub id; no class resolution, so no remote code
    runs)."""
    try:
        return config_dict(str(path))
    except UserError as e:
        raise UserError(f"model.pretrained_model_name_or_path: draft {e}; point it at a draft dir") from None


def draft_config_from_dict(raw: dict) -> DFlashDraftConfig:
    """Map a published DFlash draft config (Qwen3 fields + `block_size` + `dflash_config`) onto ours."""
    extra = raw.get("dflash_config") or {}
    data = {
        k: v for k, v in raw.items() if k not in ("dflash_config", "auto_map", "architectures", "model_type")
    }
    for key in ("block_size", "target_layer_ids", "mask_token_id"):
        if extra.get(key) is not None:
            data[key] = extra[key]
    data["use_cache"] = False
    return DFlashDraftConfig(**data)


def load_draft(
    path: str | Path, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Load a draft dir: ours (`model_type: dflash_draft`), a checkpoint with its own class
    (`auto_map`) through `AutoModel` only when `trust_remote_code`, else its weights into our class."""
    raw = read_draft_config_dict(path)
    kwargs = {"dtype": dtype, **pretrained_kwargs()}  # under models.meta.build_on_meta: no weight read
    if raw.get("model_type") == DFlashDraftConfig.model_type:
        return DFlashDraftModel.from_pretrained(path, **kwargs)
    if raw.get("auto_map") and trust_remote_code:
        return AutoModel.from_pretrained(path, trust_remote_code=True, **kwargs)
    return DFlashDraftModel.from_pretrained(path, config=draft_config_from_dict(raw), **kwargs)
