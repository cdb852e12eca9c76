"""Build the trainable backbone: `from_pretrained` (hub id, local dir, GGUF) or a tiny random decoder.

    from dllmflow.models.build import build_model
    model = build_model(settings, tokenizer)      # fp32 master weights, vocab covers the tokenizer

A pretrained dir is checked on load (models/integrity.py): a truncated weight file, a missing,
unexpected, reshaped, integer or non-finite tensor is a UserError naming it. The tiny path (tests, CPU demo) builds a Qwen3/Llama config from `model.tiny` with vocab =
`len(tokenizer)` and the tokenizer's pad/eos/mask ids. Weights are drawn from the global RNG, so
seed it first (the trainer seeds with `train.seed`) to get identical replicas on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dllmflow.errors import UserError
from dllmflow.models.integrity import check_checkpoint_files, check_loaded_weights
from dllmflow.models.meta import on_meta, pretrained_kwargs
from dllmflow.models.shipped_configs import planned_from_shipped, resolve_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from dllmflow.settings import Settings, TinyModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(settings: Settings, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The configured model with master weights in `model.torch_dtype` (fp32 by default)."""
    cfg = settings.model
    dtype = DTYPES[cfg.torch_dtype]
    if cfg.tiny is not None:
        model = build_tiny_model(cfg.tiny, tokenizer, attn_implementation=cfg.attn_implementation)
        return model.to(dtype)
    model = _from_pretrained(settings, dtype)
    # A tokenizer that gained specials (<mask>, <pad>) needs rows for them in the embedding.
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        check_new_rows_train(model, settings, tokenizer, rows)
        model.resize_token_embeddings(len(tokenizer))
    _set_token_ids(model.config, tokenizer)
    return model


def check_new_rows_train(model: PreTrainedModel, settings: Settings, tokenizer, rows: int) -> None:
    """Tokens the checkpoint has no embedding row for (a <mask> added to a tokenizer that had none) get
    new, untrained rows. Full fine-tuning trains them; LoRA freezes the embedding, so it must list the
    input embedding in `peft.modules_to_save` (trained in full), else a UserError naming the field."""
    peft = settings.peft
    if peft is None or not peft.enabled:
        return
    embedding = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is embedding)
    if any(entry in (name, name.rpartition(".")[2]) for entry in peft.modules_to_save):
        return
    new = tokenizer.convert_ids_to_tokens(list(range(rows, len(tokenizer))))
    raise UserError(
        f"peft.modules_to_save: the tokenizer has {len(new)} token(s) the checkpoint has no embedding row for "
        f"({', '.join(map(repr, new[:4]))}: e.g. a mask token added because the tokenizer had none); LoRA "
        f"would leave their new rows untrained: add {name.rpartition('.')[2]!r} to peft.modules_to_save "
        f"(a tied lm_head stays tied), or set dllm.mask_token_id to a token the checkpoint already has"
    )


def build_tiny_model(
    tiny: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """A randomly initialised Qwen3 / Llama decoder sized by `model.tiny` (100k-300k params in tests)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[tiny.architecture]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.hidden_size // tiny.num_attention_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
        use_cache=False,
    )
    _set_token_ids(config, tokenizer)
    config._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _from_pretrained(settings: Settings, dtype: torch.dtype) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    cfg = settings.model
    name = cfg.pretrained_model_name_or_path
    field = "model.pretrained_model_name_or_path"
    if _looks_local(name) and not Path(name).expanduser().exists() and not planned_from_shipped(name):
        raise UserError(f"{field}={name!r}: no such directory; point it at a model dir or a hub id")
    # under models.meta.build_on_meta: the skeleton only, no weight read
    kwargs: dict = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code, **pretrained_kwargs()}
    if cfg.gguf_file:
        if Path(name).is_dir() and not (Path(name) / cfg.gguf_file).is_file():
            raise UserError(f"model.gguf_file={cfg.gguf_file!r} is not a file inside {name}")
        kwargs["gguf_file"] = cfg.gguf_file
    else:
        kwargs["attn_implementation"] = cfg.attn_implementation
    knobs = {
        k: getattr(cfg, k)
        for k in ("dlm_paradigm", "block_size", "canvas_length")
        if getattr(cfg, k) is not None
    }
    # Weights read (not the meta skeleton): a local dir's files are checked whole first, then the load
    # report names damaged tensors (models/integrity.py). On meta no weight is read; rank 0's eager
    # build, whose state dict fills the skeleton, is the one checked.
    check = not on_meta()
    local = not cfg.gguf_file and Path(name).expanduser().is_dir()
    header = check_checkpoint_files(name) if check and local else {}
    # a reshaped tensor is reported by name (the check below, or models/sharded_load.py on meta)
    kwargs["ignore_mismatched_sizes"] = True
    if check:
        kwargs["output_loading_info"] = True
    try:
        if knobs:
            # family knobs go on the config: a class whose config lacks one would get it as an init kwarg
            gguf = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
            kwargs["config"] = resolve_config(name, trust_remote_code=cfg.trust_remote_code, **gguf, **knobs)
        loaded = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        hint = " (set model.trust_remote_code: true)" if "trust_remote_code" in str(e) else ""
        raise UserError(f"{field}={name!r}: cannot load the model{hint}: {str(e).splitlines()[0]}") from e
    model = loaded[0] if check else loaded
    if check:
        check_loaded_weights(model, loaded[1], header, f"{field}={name}")
    if cfg.gguf_file:
        # A GGUF-loaded model refuses save_pretrained (the consolidated export): keep a plain model
        # of the same class holding the dequantised weights instead.
        model.config._attn_implementation = cfg.attn_implementation
        plain = type(model)(model.config).to(dtype)
        plain.load_state_dict(model.state_dict())
        model = plain
    return model


def _looks_local(name: str) -> bool:
    """Hub ids are `org/name`; anything absolute, relative-dotted or deeper is a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def _set_token_ids(config, tokenizer: PreTrainedTokenizerBase) -> None:
    # The samplers and the exported checkpoint read these from config.json.
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id", "mask_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            setattr(config, attr, value)
