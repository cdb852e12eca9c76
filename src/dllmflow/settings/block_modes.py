"""The `dllm:` sections of the two modes that train a causal LM in blocks after the prompt
(docs/strategies.md §2.8, §2.10): `block_causal` (bidirectional inside a block, the MDLM loss) and
`causal_blocks` (causal everywhere: next-token loss plus a lookahead loss from [MASK] slots).

They were one mode, `block_causal` with `block_attention: bidirectional|causal`, until causal blocks got
a mode of their own. A recipe that still says `block_attention` gets a one-line error naming the mode
to set; a settings.json recorded before the split (a dump: every field of the old section) loads as
the mode it trained (`BlockCausalConfig.upgrade_recorded`). Imports no torch.

    from dllmflow.settings import load_settings
    load_settings(dllm={"mode": "causal_blocks", "block_size": 8}, eval={"block_size": 8}).dllm
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, PositiveInt, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from .dllm import DLLMBaseConfig, register_mode_config

# llada2's preset block size (samplers/configs.py LLaDA2Config.block_size; settings import no sampler).
LLADA2_PRESET_BLOCK_SIZE = 32

CAUSAL_BLOCKS = "causal_blocks"

# Every field of `block_causal`'s section while it held both objectives (e058975 to the split): a
# settings.json dump names them all, a recipe names a few, so only a dump is read as the mode it trained.
RECORDED_BEFORE_SPLIT = frozenset(
    {"mode", "mask_token_id", "eps", "pad_block_size", "pad_seq_len_divisible", "supervise_padding",
     "block_size", "mask_pattern", "block_attention", "lookahead_weight", "logit_shift", "causal_prompt"}
)  # fmt: skip


def field_error(config_cls: type, field: str, value: Any, message: str) -> ValidationError:
    """A validation error located at `dllm.<field>` (its origin file then named), with `message`."""
    error = PydanticCustomError("moved_field", message)
    return ValidationError.from_exception_data(
        config_cls.__name__, [{"type": error, "loc": (field,), "input": value}]
    )


def check_llada2_blocks(mode: str, block_size: int, eval_section: Any) -> None:
    """llada2 must decode the blocks the model was trained on: `eval.block_size` unset means llada2's
    preset, LLADA2_PRESET_BLOCK_SIZE (samplers/configs.py, a test keeps the two equal)."""
    given = eval_section.block_size
    decoded = LLADA2_PRESET_BLOCK_SIZE if given is None else given
    if decoded != block_size:
        raise ValueError(
            f"eval.block_size: the {mode} model is trained on blocks of dllm.block_size={block_size}, but "
            f"llada2 would decode blocks of {decoded}; set eval.block_size: {block_size}"
        )


class _BlockFields(DLLMBaseConfig):
    """What both modes share: blocks after the prompt, each row its own prompt length."""

    packing_refusal: ClassVar[str | None] = "each row's blocks start where its own prompt ends"
    block_size: PositiveInt = Field(
        32,
        description="Tokens per block, counted from the prompt's end; decode with llada2 at this block_size.",
    )
    causal_prompt: bool = Field(
        True,
        description="The prompt attends causally, as in the causal LM it starts from (else bidirectionally, "
        "llada2's preset); recorded in the export's config.json, which llada2 reads.",
    )

    def check_eval(self, eval_section: Any) -> None:
        check_llada2_blocks(self.mode, self.block_size, eval_section)  # type: ignore[attr-defined]


@register_mode_config
class BlockCausalConfig(_BlockFields):
    """Block-causal A2D (docs/strategies.md §2.8): a causal LM trained to decode as llada2 does, blocks
    after the prompt, attention causal across blocks and bidirectional inside one (SDAR, Fast-dLLM v2)."""

    mode: Literal["block_causal"]
    rl_refusal: ClassVar[str | None] = (
        "GRPO's estimators score a bidirectional denoiser, not one block at a time"
    )
    mask_pattern: Literal["random", "suffix"] = Field(
        "random",
        description="Which positions of the drawn block are masked: random (MDLM: each with p = eps + "
        "(1-eps) t) or suffix (a clean prefix of random length, the rest masked: the views a left-to-right "
        "fill meets; every masked position weighted 1).",
    )
    logit_shift: bool = Field(
        True,
        description="Position i's logit is read from position i-1, the alignment of the causal LM it starts "
        "from (models/logit_shift.py); a block's first token is then predicted from the position before it.",
    )

    @classmethod
    def upgrade_recorded(cls, value: dict[str, Any]) -> dict[str, Any]:
        """A section recorded before the split (every field of the old one) without its gone fields, as
        `causal_blocks` when it trained causal blocks (their mask pattern and shift were fixed already)."""
        if not RECORDED_BEFORE_SPLIT <= value.keys():
            return value
        if value["block_attention"] == "causal":
            gone = ("block_attention", "mask_pattern", "logit_shift")
            return {**{k: v for k, v in value.items() if k not in gone}, "mode": CAUSAL_BLOCKS}
        return {k: v for k, v in value.items() if k not in ("block_attention", "lookahead_weight")}

    @model_validator(mode="before")
    @classmethod
    def _causal_blocks_moved(cls, data: Any) -> Any:
        """A recipe written when causal blocks were `block_attention: causal` of this mode: one line
        naming the mode that trains them now."""
        if not isinstance(data, dict):
            return data
        if "block_attention" in data:
            value = data["block_attention"]
            message = (
                f"causal is now its own mode: set dllm.mode: {CAUSAL_BLOCKS} and remove block_attention, "
                "mask_pattern and logit_shift"
                if value == "causal"
                else f"block_causal's blocks are always bidirectional now; remove it (causal blocks: "
                f"dllm.mode: {CAUSAL_BLOCKS})"
            )
            raise field_error(cls, "block_attention", value, message)
        if "lookahead_weight" in data:
            raise field_error(
                cls, "lookahead_weight", data["lookahead_weight"],
                f"weights the lookahead loss of dllm.mode: {CAUSAL_BLOCKS}; block_causal has none",
            )  # fmt: skip
        return data


@register_mode_config
class CausalBlocksConfig(_BlockFields):
    """Causal blocks (docs/strategies.md §2.10): the model stays a causal LM everywhere, each supervised
    token keeps the `ar` mode's next-token loss, and the drawn block's masked suffix, appended after the
    clean row at its own positions, adds a lookahead loss. The suffix pattern and the logit shift are what
    the mode is, not options. Recorded in config.json (`dllm_causal_blocks`), which llada2 reads; selfspec
    decodes it losslessly (§3.10)."""

    mode: Literal["causal_blocks"]
    rl_refusal: ClassVar[str | None] = (
        "GRPO's estimators score a bidirectional denoiser, not a causal LM's lookahead"
    )
    lookahead_weight: float = Field(
        1.0, gt=0.0, description="Weight of the lookahead (masked suffix) loss beside the next-token loss."
    )

    @model_validator(mode="before")
    @classmethod
    def _fixed_by_the_mode(cls, data: Any) -> Any:
        fixed = {
            "mask_pattern": "masks a suffix of the drawn block",
            "logit_shift": "reads each logit one position early (the causal LM's alignment)",
            "block_attention": "attends causally inside a block",
        }
        if isinstance(data, dict):
            for name, why in fixed.items():
                if name in data:
                    raise field_error(cls, name, data[name], f"{CAUSAL_BLOCKS} always {why}; remove it")
        return data
