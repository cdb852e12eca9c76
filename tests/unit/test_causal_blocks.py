"""`causal_blocks` (diffusion/strategies/causal_blocks.py, settings/block_modes.py, docs/strategies.md §2.10):
the next-token + lookahead loss against HF's own causal forward one target at a time, the logged
`lookahead`, the model a plain causal forward that llada2 decodes so, and the split from `block_causal`:
an old recipe gets one line naming the mode, old recorded settings and exports load as causal_blocks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from test_block_causal import M, _rows, _Tok
from test_mdlm import _tiny_qwen3

from dllmflow.diffusion.modes import MODES, SamplerMisfitError, build_mode_model, check_sampler
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.diffusion.strategies.block_causal import block_causal_logits
from dllmflow.diffusion.strategies.causal_blocks import CausalBlocksStrategy
from dllmflow.models.causal_prompt import CAUSAL_BLOCKS_ATTR, has_causal_blocks, has_causal_prompt
from dllmflow.models.logit_shift import apply_logit_shift, is_logit_shifted
from dllmflow.models.model_card import CAUSAL_BLOCKS_FLAG, read_dllm_block
from dllmflow.runs import recorded_settings
from dllmflow.settings import BlockCausalConfig, CausalBlocksConfig, Settings, load_settings
from dllmflow.settings.loader import SettingsError

ROOT = Path(__file__).resolve().parents[2]
DLLM = {"mode": "causal_blocks", "mask_token_id": M, "block_size": 4}
# What the code before the split recorded in settings.json for params/smollm2_block_causal_lora.yaml
# (block_attention: causal) and for params/tiny_block_causal.yaml: every field, in the order it wrote them.
RECORDED_CAUSAL = {"mask_token_id": 16, "eps": 0.001, "pad_block_size": None, "pad_seq_len_divisible": None,
                   "supervise_padding": False, "mode": "block_causal", "block_size": 8, "mask_pattern": "suffix",
                   "block_attention": "causal", "lookahead_weight": 0.25, "logit_shift": True,
                   "causal_prompt": True}  # fmt: skip
RECORDED_BIDIRECTIONAL = {**RECORDED_CAUSAL, "mask_token_id": 2, "mask_pattern": "random",
                          "block_attention": "bidirectional", "lookahead_weight": 1.0}  # fmt: skip


def _reference_lookahead(model, batch):
    """One row and one target at a time with HF's own causal forward (no 4D mask): the clean row's
    next-token CE at every supervised position, and for the drawn suffix k..k+m-1, x[k+t] (t >= 1) from
    the last logit of x[:k] followed by t masks."""
    ar = ahead = 0.0
    x = batch["input_ids"]
    with torch.no_grad():
        for r in range(x.shape[0]):
            raw = model(input_ids=x[r : r + 1]).logits[0]
            for i in range(1, x.shape[1]):
                if batch["loss_mask"][r, i] and batch["attention_mask"][r, i]:
                    ar += F.cross_entropy(raw[i - 1], x[r, i]).item()
            masked = batch["noise_mask"][r].nonzero().squeeze(1).tolist()
            for t in range(1, len(masked)):
                k = masked[0]
                ids = torch.cat([x[r, :k], torch.full((t,), M)])[None]
                ahead += F.cross_entropy(model(input_ids=ids).logits[0, -1], x[r, k + t]).item()
    return ar, ahead


def test_the_loss_is_the_next_token_loss_of_the_clean_row_plus_the_lookahead():
    strategy = build_strategy(load_settings(dllm={**DLLM, "lookahead_weight": 0.25}, eval={"block_size": 4}))
    assert isinstance(strategy, CausalBlocksStrategy)
    model = apply_logit_shift(_tiny_qwen3())
    batch = _rows()
    batch.update(strategy.corrupt(batch, seeds=[10, 11, 12]))
    noise = batch["noise_mask"]
    m = noise.sum(1)
    assert m[0] >= 2 or m[1] >= 2  # some lookahead target to score
    for r in range(2):  # always the suffix pattern: the block's supervised positions from the first mask on
        sup_in_block = (batch["block"][r] & (batch["loss_mask"][r] != 0)).nonzero().squeeze(1).tolist()
        masked = noise[r].nonzero().squeeze(1).tolist()
        assert masked and masked == sup_in_block[sup_in_block.index(masked[0]) :]
    counts = strategy.token_counts(batch)
    assert set(counts) == {"ar", "lookahead"}
    assert counts["ar"] == 11 + 4  # every supervised token of rows 0 and 1 (row 2 supervises none)
    assert counts["lookahead"] == (m - 1).clamp_min(0).sum()
    out = strategy.loss(model, batch)
    want_ar, want_ahead = _reference_lookahead(model, batch)
    assert set(out.sums) == {"ar", "lookahead"} and out.dllm_terms == ("lookahead",)
    assert math.isclose(out.sums["ar"].item(), want_ar, rel_tol=1e-5)
    assert math.isclose(out.sums["lookahead"].item(), want_ahead, rel_tol=1e-5)
    assert out.weight("lookahead") == 0.25 and out.weight("ar") == 1.0
    # logged: the unweighted mean over the step's lookahead targets (sums over micro-batches first)
    logged = strategy.finalize_metrics({k: 2 * float(v) for k, v in out.metric_sums.items()})
    assert logged.keys() == {"lookahead"}
    assert math.isclose(logged["lookahead"], want_ahead / float(counts["lookahead"]), rel_tol=1e-5)
    sum(out.sums.values()).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_model_is_a_plain_causal_forward_and_llada2_decodes_it_so(tmp_path):
    """The mode trains a causal LM (the training logits are HF's own causal forward, read one position
    early); its builder flags it, the flag travels in config.json and llada2 then decodes causally,
    cached or not. block_causal's builder sets no such flag."""
    tiny = {"hidden_size": 32, "intermediate_size": 64}
    settings = load_settings(dllm=DLLM, eval={"block_size": 4}, model={"tiny": tiny})
    torch.manual_seed(0)
    model = build_mode_model(settings, _Tok()).eval()
    assert has_causal_blocks(model) and has_causal_prompt(model) and is_logit_shifted(model)
    bidirectional = load_settings(
        dllm={**DLLM, "mode": "block_causal"}, eval={"block_size": 4}, model={"tiny": tiny}
    )
    assert not has_causal_blocks(build_mode_model(bidirectional, _Tok()))
    batch = _rows()
    batch.update(build_strategy(settings).corrupt(batch, seeds=[1, 2, 3]))
    cols = torch.arange(1, 16)
    with torch.no_grad():
        got = block_causal_logits(model, batch, cols, 1, True, M)  # [3, 15, V]
        raw = model(input_ids=batch["noisy_input_ids"][:, :16]).logits  # HF's causal mask, no 4D mask
    torch.testing.assert_close(got[0], raw[0, cols - 1], rtol=1e-5, atol=1e-5)  # row 0: no padding before 16
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())[CAUSAL_BLOCKS_ATTR] is True
    loaded = type(model).from_pretrained(tmp_path).eval()

    def run(m, cache):
        over = {"max_new_tokens": 8, "steps": 4, "block_size": 4, "threshold": 0.5, "cache": cache}
        config = build_sampler_config("llada2", over)
        return (
            SAMPLERS["llada2"](m, _Tok(), config, mask_id=M)
            .generate([[5, 6, 7], [9, 10, 11, 12, 13]])
            .sequences
        )

    assert run(loaded, "exact") == run(loaded, "none")


def test_the_registry_holds_the_split():
    assert (
        MODES["causal_blocks"].config is CausalBlocksConfig
        and MODES["block_causal"].config is BlockCausalConfig
    )
    assert MODES["causal_blocks"].samplers == ("llada2", "selfspec")
    assert MODES["block_causal"].samplers == ("llada2",)
    assert type(build_strategy(load_settings(dllm=DLLM, eval={"block_size": 4}))) is CausalBlocksStrategy
    assert {"mask_pattern", "logit_shift", "block_attention"}.isdisjoint(CausalBlocksConfig.model_fields)
    assert {"block_attention", "lookahead_weight"}.isdisjoint(BlockCausalConfig.model_fields)


def test_an_old_recipe_gets_one_line_naming_the_new_mode(tmp_path):
    recipe = tmp_path / "old.yaml"
    old = {"mode": "block_causal", "block_size": 8, "block_attention": "causal", "mask_pattern": "suffix"}
    recipe.write_text(yaml.safe_dump({"dllm": old, "eval": {"block_size": 8}}))
    with pytest.raises(SettingsError) as e:
        load_settings(recipe)
    assert str(e.value) == (
        "invalid setting: dllm.block_attention: causal is now its own mode: set dllm.mode: causal_blocks and "
        f"remove block_attention, mask_pattern and logit_shift [from {recipe}]"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dllm": {"mode": "block_causal", "block_attention": "bidirectional"}},
         "dllm.block_attention: block_causal's blocks are always bidirectional now; remove it"),
        ({"dllm": {"mode": "block_causal", "lookahead_weight": 0.5}},
         "dllm.lookahead_weight: weights the lookahead loss of dllm.mode: causal_blocks; block_causal has none"),
        ({"dllm": {"mode": "causal_blocks", "mask_pattern": "suffix"}},
         "dllm.mask_pattern: causal_blocks always masks a suffix of the drawn block; remove it"),
        ({"dllm": {"mode": "causal_blocks", "logit_shift": True}},
         "dllm.logit_shift: causal_blocks always reads each logit one position early"),
        ({"dllm": {"mode": "causal_blocks", "block_attention": "causal"}},
         "dllm.block_attention: causal_blocks always attends causally inside a block; remove it"),
        ({"dllm": {"mode": "causal_blocks", "lookahead_weight": 0}},
         r"dllm\.lookahead_weight: Input should be greater than 0"),
        ({"dllm": {"mode": "causal_blocks", "block_size": 8}},
         r"eval\.block_size: the causal_blocks model is trained on blocks of dllm\.block_size=8"),
        ({"dllm": {"mode": "causal_blocks"}, "dataset": {"packing": True}}, "packing"),
    ],
)  # fmt: skip
def test_what_the_settings_refuse_in_one_line(overrides, message):
    with pytest.raises(SettingsError, match=message) as e:
        load_settings(**overrides)
    assert "\n" not in str(e.value)


def _recorded(tmp_path, dllm: dict):
    """An export dir whose settings.json is a full dump of today's tiny recipe with `dllm` in it."""
    data = load_settings(ROOT / "params" / "tiny_causal_blocks.yaml").to_dict()
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "settings.json").write_text(json.dumps({**data, "dllm": dllm}))
    return tmp_path


def test_settings_recorded_before_the_split_load_as_the_mode_they_trained(tmp_path):
    causal = recorded_settings(_recorded(tmp_path / "causal", RECORDED_CAUSAL))  # load_settings_json
    assert causal.dllm == CausalBlocksConfig(
        mode="causal_blocks", mask_token_id=16, block_size=8, lookahead_weight=0.25, causal_prompt=True
    )
    assert Settings.model_validate(json.loads((tmp_path / "causal" / "settings.json").read_text())) == causal
    assert type(build_strategy(causal)) is CausalBlocksStrategy
    again = Settings.model_validate(causal.to_dict())  # the upgraded dump reads back unchanged
    assert again == causal and again.to_dict()["dllm"]["mode"] == "causal_blocks"
    bidirectional = recorded_settings(_recorded(tmp_path / "bidirectional", RECORDED_BIDIRECTIONAL))
    assert bidirectional.dllm == BlockCausalConfig(
        mode="block_causal", mask_token_id=2, block_size=8, mask_pattern="random", logit_shift=True
    )
    # only a full dump is read so: the same section missing one field is a recipe, refused in one line
    partial = {k: v for k, v in RECORDED_CAUSAL.items() if k != "pad_block_size"}
    with pytest.raises(SettingsError, match="causal is now its own mode: set dllm.mode: causal_blocks"):
        recorded_settings(_recorded(tmp_path / "partial", partial))


def test_an_export_of_causal_blocks_from_before_the_split_reads_as_causal_blocks(tmp_path):
    assert CAUSAL_BLOCKS_FLAG == CAUSAL_BLOCKS_ATTR  # model_card's torch-free copy
    block = {"mode": "block_causal", "default_sampler": "llada2", "mask_token_id": 16}
    (tmp_path / "config.json").write_text(json.dumps({"dllm": block, CAUSAL_BLOCKS_ATTR: True}))
    read = read_dllm_block(tmp_path)
    assert read == {**block, "mode": "causal_blocks"}
    check_sampler(read["mode"], "selfspec")
    (tmp_path / "config.json").write_text(json.dumps({"dllm": block}))  # bidirectional blocks: no flag
    assert read_dllm_block(tmp_path) == block
    with pytest.raises(SamplerMisfitError):
        check_sampler(read_dllm_block(tmp_path)["mode"], "selfspec")
