"""`selfspec` (diffusion/samplers/selfspec.py): lossless self-speculative decoding of a `causal_blocks`
model. The reference is the `ar` sampler's greedy decoding of the same model: the tokens
must be equal while drafts cut the forwards. The model is a tiny causal-blocks Qwen3 trained for a few
seconds (the mode's own corruption and loss) on arithmetic progressions, so its [MASK]-slot drafts are
right often but not always: full and partial acceptance both happen."""

from __future__ import annotations

import pytest
import torch
from test_block_causal import M, _Tok
from test_mdlm import _tiny_qwen3
from test_sampler_stepper import stepped

from dllmflow.diffusion.modes import SamplerMisfitError, build_mode_model, check_sampler
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config
from dllmflow.diffusion.samplers.configs import SamplerSettingError
from dllmflow.diffusion.samplers.selfspec import accepted_drafts
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.settings import load_settings
from dllmflow.settings.loader import SettingsError

PROMPTS = [[3, 5, 7, 9], [10, 11, 12], [20, 22], [30, 31, 32, 33, 34]]
CAUSAL = {"mode": "causal_blocks", "mask_token_id": M, "block_size": 4}


def _progressions(n: int, g: torch.Generator) -> dict:
    """Rows of 16 ids counting up by 1 or 2 from a random start (ids 1..44: 0 is the pad, a stop id)."""
    start, step = torch.randint(1, 40, (n, 1), generator=g), torch.randint(1, 3, (n, 1), generator=g)
    loss_mask = torch.zeros(n, 16)
    loss_mask[:, 4:] = 1
    x = (start + step * torch.arange(16)) % 44 + 1  # [n, 16]
    return {"input_ids": x, "loss_mask": loss_mask, "attention_mask": torch.ones(n, 16, dtype=torch.long)}


@pytest.fixture(scope="module")
def drafter():
    """A causal_blocks model after 300 steps of its mode's loss (next-token + lookahead)."""
    settings = load_settings(dllm=CAUSAL, eval={"block_size": 4}, dataset={"seq_length": 16},
                             model={"tiny": {"hidden_size": 64, "intermediate_size": 128}})  # fmt: skip
    torch.manual_seed(0)
    model = build_mode_model(settings, _Tok())
    strategy = build_strategy(settings)
    strategy.setup(model, _Tok(), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(300):
        batch = _progressions(32, g)
        batch.update(strategy.corrupt(batch, seeds=list(range(32 * step, 32 * step + 32))))
        sums, counts = strategy.loss(model, batch).sums, strategy.token_counts(batch)
        loss = sums["ar"] / counts["ar"] + sums["lookahead"] / counts["lookahead"].clamp_min(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _decode(model, sampler: str, prompts, tok=None, **over):
    config = build_sampler_config(sampler, {"max_new_tokens": 12, **over})
    return SAMPLERS[sampler](model, tok or _Tok(), config, mask_id=M).generate(prompts)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_the_answers_are_the_models_greedy_ones_in_fewer_forwards(drafter, block_size):
    ar = _decode(drafter, "ar", PROMPTS)
    spec = _decode(drafter, "selfspec", PROMPTS, block_size=block_size)
    assert spec.sequences == ar.sequences
    assert all(len(s) == 12 for s in spec.sequences)  # max_new_tokens, no stop id produced
    if block_size == 1:  # no drafts: one token a forward, as the ar sampler
        assert spec.row_nfe == ar.row_nfe
    else:  # drafts accepted: fewer forwards, and some row had one rejected (not every forward full)
        assert sum(spec.row_nfe) < sum(ar.row_nfe)
        assert any(n > -(-12 // block_size) for n in spec.row_nfe)


def test_a_row_decodes_as_it_would_alone(drafter):
    batch = _decode(drafter, "selfspec", PROMPTS, block_size=4)
    for i, p in enumerate(PROMPTS):
        alone = _decode(drafter, "selfspec", [p], block_size=4)
        assert alone.sequences[0] == batch.sequences[i]
        assert alone.row_nfe[0] == batch.row_nfe[i]


class _StopAt25(_Tok):
    eos_token_id = 25


def test_a_row_stops_at_its_stop_id_and_leaves_the_batch(drafter):
    ar = _decode(drafter, "ar", PROMPTS, tok=_StopAt25())
    spec = _decode(drafter, "selfspec", PROMPTS, tok=_StopAt25(), block_size=4)
    assert spec.sequences == ar.sequences
    stopped = [i for i, s in enumerate(ar.sequences) if len(s) < 12]  # trimmed at 25
    assert stopped  # the reference stops somewhere, so the check means something
    for i in stopped:
        assert spec.row_nfe[i] <= ar.row_nfe[i]
        assert spec.row_positions[i] < 100  # it left the forwards (a dozen per forward at most)


def test_a_stop_draft_is_never_fed_and_the_answer_still_ends_there(drafter):
    """The position before a stop draft checks it: feeding the stop id itself would cost a position
    whose output nothing commits. Alone (one row), no forward after the prompt's feeds 25."""
    ar = _decode(drafter, "ar", PROMPTS, tok=_StopAt25())
    assert any(len(s) < 12 for s in ar.sequences)  # some answer ends at the stop id (trimmed off)
    for p, expected in zip(PROMPTS, ar.sequences):
        fed = []  # input_ids [1, Q] of every forward
        hook = drafter.register_forward_pre_hook(
            lambda m, a, kw, fed=fed: fed.append(kw["input_ids"][0].tolist()), with_kwargs=True
        )
        try:
            alone = _decode(drafter, "selfspec", [p], tok=_StopAt25(), block_size=4)
        finally:
            hook.remove()
        assert alone.sequences == [expected]
        assert all(25 not in ids for ids in fed[1:]), fed


def test_stepping_gives_generates_tokens_and_dropped_rows_leave_the_others_as_alone(drafter):
    config = build_sampler_config("selfspec", {"max_new_tokens": 12, "block_size": 4})
    sampler = SAMPLERS["selfspec"](drafter, _StopAt25(), config, mask_id=M)
    whole = sampler.generate(PROMPTS)
    stepper, seen = sampler.stepper(PROMPTS), []
    while (progress := stepper.step()) is not None:
        if seen:  # what a row committed is final: later steps only extend it
            assert all(now[: len(before)] == before for now, before in zip(progress.tokens, seen[-1].tokens))
        seen.append(progress)
    assert len(seen) == max(whole.row_nfe) - 1  # a pause before every forward but the first
    assert stepper.result.sequences == whole.sequences and stepper.result.row_nfe == whole.row_nfe
    assert any(seen[-1].done) and not all(seen[-1].done)  # a row stopped at 25 while others decode on
    _, kept = stepped(sampler, PROMPTS, drop_after_first=[3, 1])
    assert kept.sequences == [whole.sequences[i] for i in (3, 1)]
    assert kept.row_nfe == [whole.row_nfe[i] for i in (3, 1)]


@pytest.mark.parametrize("cap", [8, 12, 28])
def test_a_batch_positions_cap_bounds_each_forward_and_keeps_the_answers(drafter, cap):
    """b live rows feed at most `cap` positions a forward after the prompt's: 1 + 2 * min(3, (cap // b
    - 1) // 2) each. 4 rows at cap 8 take plain ar steps (the ar sampler's forwards and positions
    exactly); at cap 12 one draft and one slot each while 4 rows are live; at cap 28 (7 a row) the
    uncapped block-4 forwards."""
    fed = []  # [b, Q] of every forward
    hook = drafter.register_forward_pre_hook(
        lambda m, a, kw: fed.append(kw["input_ids"].shape), with_kwargs=True
    )
    try:
        capped = _decode(drafter, "selfspec", PROMPTS, block_size=4, batch_positions=cap)
    finally:
        hook.remove()
    ar = _decode(drafter, "ar", PROMPTS)
    full = _decode(drafter, "selfspec", PROMPTS, block_size=4)
    assert capped.sequences == ar.sequences  # lossless at every cap
    assert all(b * q <= max(cap, b) for b, q in fed[1:])  # a row always feeds its pending token
    if cap == 8:
        assert capped.row_nfe == ar.row_nfe and capped.row_positions == ar.row_positions
    elif cap == 12:
        assert (4, 3) in fed[1:]
        assert sum(ar.row_nfe) > sum(capped.row_nfe) > sum(full.row_nfe)
    else:
        assert capped.row_nfe == full.row_nfe and capped.row_positions == full.row_positions


def test_the_batch_positions_flag_reaches_the_config_and_is_checked():
    import argparse

    from dllmflow.inference.generate import add_cli_args, flag_config, sampler_overrides

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    base = ["--checkpoint", "x", "--prompt", "a", "--sampler", "selfspec", "--batch-positions"]
    assert flag_config("selfspec", sampler_overrides(parser.parse_args(base + ["24"]))).batch_positions == 24
    with pytest.raises(SamplerSettingError, match="--batch-positions"):
        flag_config("selfspec", sampler_overrides(parser.parse_args(base + ["0"])))
    with pytest.raises(SamplerSettingError, match="batch_positions"):  # not another sampler's knob
        build_sampler_config("llada2", {"batch_positions": 24})


def test_accepted_drafts_counts_the_leading_matches():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3], [1, 2, 4]])
    greedy = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    expected = []
    for d, g in zip(drafts.tolist(), greedy.tolist()):
        n = 0
        while n < len(d) and d[n] == g[n]:
            n += 1
        expected.append(n)
    assert accepted_drafts(drafts, greedy).tolist() == expected == [3, 1, 0, 2]


def test_what_it_refuses():
    """Which models it decodes is the registry's word (check_sampler), not the sampler's: causal_blocks
    and uno, not block_causal; the sampler itself refuses only a cache it cannot keep exact."""
    check_sampler("causal_blocks", "selfspec")
    check_sampler("uno", "selfspec")
    with pytest.raises(
        SamplerMisfitError, match=r"block_causal; sampler 'selfspec'.*fit it\. Samplers that fit: llada2$"
    ):
        check_sampler("block_causal", "selfspec")
    with pytest.raises(SamplerMisfitError, match="Samplers that fit: llada2, selfspec$"):
        check_sampler("causal_blocks", "idlm")
    with pytest.raises(SamplerSettingError, match="takes cache exact, not 'none'"):
        build_sampler_config("selfspec", {"cache": "none"})


def test_any_causal_lm_decodes_to_its_greedy_answer():
    """No flag is asked of the model (the runtime refusal went with the registry's word): an untrained
    causal LM's drafts are poor, but every committed token is still its greedy choice."""
    torch.manual_seed(0)
    model = _tiny_qwen3().eval()
    ar = _decode(model, "ar", PROMPTS)
    spec = _decode(model, "selfspec", PROMPTS, block_size=4)
    assert spec.sequences == ar.sequences


def test_the_flow_evaluates_it_for_causal_blocks_only_and_gates_the_recipes_first_sampler():
    from dllmflow.workflow.finetune import _gated_sampler, eval_samplers

    causal = load_settings(dllm=CAUSAL, eval={"block_size": 4})
    assert eval_samplers(causal) == ["llada2", "selfspec"]
    bidirectional = {"mode": "block_causal", "mask_token_id": M, "block_size": 4}
    assert eval_samplers(load_settings(dllm=bidirectional, eval={"block_size": 4})) == ["llada2"]
    evals = {"llada2": {}, "selfspec": {}, "ar_control": {}}
    assert _gated_sampler(causal, evals) == "llada2"  # the mode's default
    first = load_settings(dllm=CAUSAL, eval={"block_size": 4, "samplers": ["selfspec", "llada2"]})
    assert _gated_sampler(first, evals) == "selfspec"  # the recipe's order


def test_eval_batch_positions_reaches_selfspec_only_and_is_refused_where_no_sampler_takes_it():
    """The recipe's `eval.batch_positions` is what the flow's evaluation (and so its card and gate)
    decodes selfspec with; llada2, evaluated beside it, runs without it; a mode with no selfspec refuses it."""
    from dllmflow.diffusion.samplers.eval_knobs import eval_defaults
    from dllmflow.inference.generate import flag_config
    from dllmflow.workflow.finetune import eval_samplers

    s = load_settings(dllm=CAUSAL, eval={"block_size": 4, "batch_positions": 24})
    assert eval_samplers(s) == ["llada2", "selfspec"]
    assert flag_config("selfspec", {}, defaults=eval_defaults(s.eval, "selfspec")).batch_positions == 24
    assert (
        "batch_positions"
        not in flag_config("llada2", {}, defaults=eval_defaults(s.eval, "llada2")).model_dump()
    )
    with pytest.raises(SettingsError, match=r"eval\.batch_positions: 24 cannot be used.*mdlm"):
        eval_samplers(load_settings(dllm={"mode": "mdlm"}, eval={"batch_positions": 24}))


def test_the_bench_floor_drafts_the_greedy_answer_and_takes_two_forwards(drafter):
    """bench/vs_ar.py's floor row: selfspec whose prompt forward drafts the greedy answer itself."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "vs_ar.py"
    spec = importlib.util.spec_from_file_location("bench_vs_ar", path)
    vs_ar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_ar)
    config = build_sampler_config("selfspec", {"max_new_tokens": 5, "block_size": 4})  # 1 + 3 drafts + 1
    plain = SAMPLERS["selfspec"](drafter, _Tok(), config, mask_id=M)
    ar = _decode(drafter, "ar", PROMPTS, max_new_tokens=5)
    floor = vs_ar.oracle_drafts(plain, dict(zip(map(tuple, PROMPTS), ar.sequences))).generate(PROMPTS)
    assert floor.sequences == ar.sequences
    assert floor.row_nfe == [2] * len(PROMPTS)  # the prompt's forward, one check
    assert max(plain.generate(PROMPTS).row_nfe) > 2  # the model's own drafts miss somewhere


def _forwards(model, **over) -> list[tuple[int, int, int]]:
    """(first position, drafts fed F, [MASK] slots W) of every forward of one prompt's selfspec decoding."""
    seen = []

    def record(module, args, kw):
        ids = kw["input_ids"][0]  # [Q]: the pending token, F drafts, W slots
        slots = int((ids == M).sum())
        seen.append((int(kw["position_ids"][0, 0]), len(ids) - 1 - slots, slots))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _decode(model, "selfspec", PROMPTS[:1], max_new_tokens=24, **over)
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("block_size", [4, 8])
def test_an_adaptive_schedule_keeps_the_answers_and_sizes_each_forward_by_the_last_acceptance(
    drafter, block_size
):
    """Each forward after the second feeds W slots = one more than the drafts the previous check accepted
    (two more when it accepted every draft it was fed), between 1 and block_size - 1; the accepted count
    is read off the positions (a forward commits j + 1 tokens), independently of the sampler's bookkeeping."""
    ar = _decode(drafter, "ar", PROMPTS)
    spec = _decode(drafter, "selfspec", PROMPTS, block_size=block_size, draft_schedule="adaptive")
    assert spec.sequences == ar.sequences
    fwd = _forwards(drafter, block_size=block_size, draft_schedule="adaptive")[1:]  # after the prompt's
    D, widths = block_size - 1, set()
    for (pos, fed, _), (nxt, _, slots) in zip(fwd, fwd[1:]):
        accepted = nxt - pos - 1
        assert 0 <= accepted <= fed
        want = max(1, min(D, accepted + (2 if accepted == fed else 1))) if fed else None
        if want is not None and nxt - fwd[0][0] < 24 - block_size:  # not yet trimmed by the answer's end
            assert slots == want, (pos, fed, accepted, slots)
            widths.add(slots)
    assert len(widths) > 1  # both growing and shrinking happened, so the rule was exercised


def test_an_adaptive_schedule_feeds_fewer_positions_when_drafts_miss():
    """An untrained model's drafts rarely hold: the fixed schedule pays block_size - 1 drafts and slots a
    forward for them, the adaptive one shrinks to one of each; the answers stay the model's greedy ones."""
    settings = load_settings(dllm=CAUSAL, eval={"block_size": 4}, dataset={"seq_length": 16},
                             model={"tiny": {"hidden_size": 64, "intermediate_size": 128}})  # fmt: skip
    torch.manual_seed(3)
    model = build_mode_model(settings, _Tok()).eval()
    fixed = _decode(model, "selfspec", PROMPTS, block_size=8)
    adaptive = _decode(model, "selfspec", PROMPTS, block_size=8, draft_schedule="adaptive")
    assert adaptive.sequences == fixed.sequences == _decode(model, "ar", PROMPTS).sequences
    assert sum(adaptive.row_positions) < 0.6 * sum(fixed.row_positions)


def test_lookup_drafts_copy_what_followed_the_latest_earlier_occurrence_of_the_longest_recurring_tail():
    from dllmflow.diffusion.samplers.selfspec import lookup_drafts

    ctx = [1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 2, 3]  # tail [2, 3] occurred at 1 and 5: the latest is 5
    assert lookup_drafts(ctx, 2, 3) == [7, 6, 5]
    assert lookup_drafts(ctx, 3, 3) == [7, 6, 5]  # [5, 2, 3] never recurs: falls back to [2, 3]
    assert lookup_drafts([4, 1, 5, 9, 1], 2, 8) == [
        5,
        9,
        1,
    ]  # [9, 1] never recurs, [1] at 1; capped at the end
    assert lookup_drafts([4, 5, 6], 2, 3) == []  # nothing recurs
    assert lookup_drafts([7], 2, 3) == []


def test_lookup_drafts_keep_the_answers_and_cut_forwards_on_repeating_text():
    """An untrained model's slots draft badly; on prompts whose answer repeats (the model's greedy choice
    often loops), drafts copied from the prompt and answer so far are accepted, so fewer forwards give the
    same tokens."""
    settings = load_settings(dllm=CAUSAL, eval={"block_size": 4}, dataset={"seq_length": 16},
                             model={"tiny": {"hidden_size": 64, "intermediate_size": 128}})  # fmt: skip
    torch.manual_seed(3)
    model = build_mode_model(settings, _Tok()).eval()
    plain = _decode(model, "selfspec", PROMPTS, block_size=8, max_new_tokens=32)
    copied = _decode(model, "selfspec", PROMPTS, block_size=8, max_new_tokens=32, lookup_ngram=2)
    assert copied.sequences == plain.sequences == _decode(model, "ar", PROMPTS, max_new_tokens=32).sequences
    assert sum(copied.row_nfe) < sum(plain.row_nfe)


def test_the_draft_policies_reach_selfspec_from_the_recipe_and_the_flags_and_are_checked():
    import argparse

    from dllmflow.diffusion.samplers.eval_knobs import eval_defaults
    from dllmflow.inference.generate import add_cli_args, flag_config, sampler_overrides
    from dllmflow.workflow.finetune import eval_samplers

    s = load_settings(dllm=CAUSAL, eval={"block_size": 4, "draft_schedule": "adaptive", "lookup_ngram": 3})
    cfg = flag_config("selfspec", {}, defaults=eval_defaults(s.eval, "selfspec"))
    assert (cfg.draft_schedule, cfg.lookup_ngram) == ("adaptive", 3)
    assert (
        "lookup_ngram" not in flag_config("llada2", {}, defaults=eval_defaults(s.eval, "llada2")).model_dump()
    )
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = ["--checkpoint", "x", "--prompt", "a", "--sampler", "selfspec", "--draft-schedule", "adaptive",
            "--lookup-ngram", "2"]  # fmt: skip
    cfg = flag_config("selfspec", sampler_overrides(parser.parse_args(args)))
    assert (cfg.draft_schedule, cfg.lookup_ngram) == ("adaptive", 2)
    with pytest.raises(SamplerSettingError, match="lookup"):
        flag_config("selfspec", sampler_overrides(parser.parse_args(args[:-1] + ["-1"])))
    with pytest.raises(SettingsError, match=r"eval\.lookup_ngram: 2 cannot be used.*mdlm"):
        eval_samplers(load_settings(dllm={"mode": "mdlm"}, eval={"lookup_ngram": 2}))


def test_lookup_drafts_are_copied_from_the_text_committed_up_to_the_forward(drafter):
    """Every forward feeds as drafts what `lookup_drafts` finds in the prompt and the answer committed up
    to its pending token (read off the ar sampler's answer at the forward's first position), when it
    finds any."""
    from dllmflow.diffusion.samplers.selfspec import lookup_drafts

    prompt = [3, 5, 7, 9, 3, 5, 7]
    answer = _decode(drafter, "ar", [prompt], max_new_tokens=24).sequences[0]
    fed = []  # (first position, the ids after the pending token that are not slots)

    def record(module, args, kw):
        ids = kw["input_ids"][0].tolist()
        fed.append((int(kw["position_ids"][0, 0]), [t for t in ids[1:] if t != M]))

    hook = drafter.register_forward_pre_hook(record, with_kwargs=True)
    try:
        spec = _decode(drafter, "selfspec", [prompt], block_size=4, max_new_tokens=24, lookup_ngram=2)
    finally:
        hook.remove()
    assert spec.sequences[0] == answer
    checked = 0
    for pos, drafts in fed[1:]:  # the pending token at `pos` is answer[pos - len(prompt)]
        copied = lookup_drafts(prompt + answer[: pos - len(prompt) + 1], 2, 3)
        if copied and drafts:
            assert drafts == copied[: len(drafts)], (pos, drafts, copied)
            checked += 1
    assert checked > 2


def test_an_adaptive_schedule_feeds_copied_drafts_whole_and_keeps_the_slots_at_its_width(drafter):
    """Under `draft_schedule: adaptive`, with the width shrunk to 1 by misses, a forward whose drafts a
    row copied (`lookup_ngram`) feeds all of them, up to block_size - 1 and under a batch_positions cap,
    while its [MASK] slots stay at the width; drafts the forward made stay at the width. The answers on
    repeating text stay the `ar` sampler's."""
    cfg = build_sampler_config("selfspec", {"block_size": 8, "draft_schedule": "adaptive", "lookup_ngram": 2})
    spec = SAMPLERS["selfspec"](drafter, _Tok(), cfg, mask_id=M)
    spec._span, stop = 1, torch.tensor([0])  # the width after a check that accepted nothing
    drafts = torch.arange(1, 8)[None].repeat(2, 1)  # [2, 7] no stop id among them
    assert spec._feed(drafts, 7, 5, stop) == (5, 1)  # 5 copied: fed whole, one slot
    assert spec._feed(drafts, 7, 0, stop) == (1, 1)  # the forward's own drafts: the width
    assert spec._feed(drafts, 3, 5, stop) == (3, 1)  # never past the drafts every row holds
    capped = build_sampler_config("selfspec", {**cfg.model_dump(), "batch_positions": 8})
    spec = SAMPLERS["selfspec"](drafter, _Tok(), capped, mask_id=M)
    spec._span = 1
    assert spec._feed(drafts, 7, 5, stop) == (1, 1)  # 2 rows * (1 + 2 * 1) <= 8 positions: the cap holds
    prompt = [3, 5, 7, 9, 3, 5, 7, 9, 11]
    ar = _decode(drafter, "ar", [prompt], max_new_tokens=32).sequences
    over = {"block_size": 8, "draft_schedule": "adaptive", "lookup_ngram": 2, "max_new_tokens": 32}
    assert _decode(drafter, "selfspec", [prompt], **over).sequences == ar
