"""`uno` (diffusion/strategies/uno.py, models/drafting_adapter.py): a LoRA drafting adapter gated to
[MASK] positions on a frozen causal LM. What must hold:

* off the [MASK]s the model computes exactly what the causal LM computes (bit for bit), on clean inputs
  and on inputs with [MASK] slots appended, while the slots' logits are the adapter's;
* the loss equals an independent reference: each anchor's slots decoded alone, after x[<k], by a
  plain causal forward of the gated model (no cache, no custom mask), CE against x[k+t+1];
* selfspec decoding a trained adapter gives the causal LM's own greedy answers (the `ar` sampler's
  on the LM without any adapter), ids for ids, in fewer forwards;
* the export is the causal LM unmerged + its adapter; loading it onto other weights is refused naming both;
* bad settings fail at parse time naming the field.

The causal LM is a tiny Qwen3 first fine-tuned next-token (the `ar` mode's loss) on arithmetic
progressions, so its greedy answers are a real function the adapter can learn to guess ahead of."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_block_causal import M, _Tok
from test_selfspec import _progressions

from dllmflow.diffusion.masks.drafting import drafting_slots_mask
from dllmflow.diffusion.modes import build_mode_model
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.errors import UserError
from dllmflow.models.drafting_adapter import (
    DRAFTER_INFO,
    apply_drafting_gate,
    load_drafting_adapter,
    weights_digest,
)
from dllmflow.models.lora import apply_lora, export_with_lora
from dllmflow.settings import load_settings
from dllmflow.settings.loader import SettingsError

PROMPTS = [[3, 5, 7, 9], [10, 11, 12], [20, 22], [30, 31, 32, 33, 34]]
UNO = {"mode": "uno", "mask_token_id": M, "block_size": 4, "anchors": 3}
TINY = {"tiny": {"hidden_size": 64, "intermediate_size": 128}}


def _settings(**dllm):
    return load_settings(dllm={**UNO, **dllm}, peft={"r": 8, "alpha": 16}, dataset={"seq_length": 16},
                         eval={"block_size": 4}, model=TINY)  # fmt: skip


def _train(model, strategy, steps: int, seed: int, terms: tuple[str, ...]) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = _progressions(32, g)
        batch.update(strategy.corrupt(batch, seeds=list(range(32 * step, 32 * step + 32))))
        sums, counts = strategy.loss(model, batch).sums, strategy.token_counts(batch)
        loss = sum(sums[k] / counts[k].clamp_min(1) for k in terms)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture(scope="module")
def causal_lm():
    """The frozen causal LM: a tiny Qwen3 after 150 next-token steps (the `ar` mode's loss)."""
    settings = load_settings(dllm={"mode": "ar", "mask_token_id": M}, dataset={"seq_length": 16}, model=TINY)
    torch.manual_seed(0)
    model = build_mode_model(settings, _Tok())
    _train(model, build_strategy(settings), 150, seed=1, terms=("ar",))
    return model.eval()


@pytest.fixture(scope="module")
def drafter(causal_lm):
    """The causal LM with a drafting adapter trained 200 steps by the uno strategy."""
    settings = _settings()
    model = apply_lora(copy.deepcopy(causal_lm), settings)
    strategy = build_strategy(settings)
    strategy.setup(model, _Tok(), torch.device("cpu"))
    model.train()
    _train(model, strategy, 200, seed=2, terms=("draft",))
    return model.eval()


def _random_adapter(causal_lm):
    """The causal LM with a gated adapter whose B is random (not peft's zeros): it changes what it touches."""
    model = apply_lora(copy.deepcopy(causal_lm), _settings())
    torch.manual_seed(5)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    return apply_drafting_gate(model, M).eval()


def test_off_the_masks_the_model_is_the_causal_lm_bit_for_bit(causal_lm):
    model = _random_adapter(causal_lm)
    x = torch.tensor([[3, 5, 7, 9, 11, 13, M, M, M, 21], [1, 2, 3, M, 5, 6, 7, 8, M, 10]])
    clean = torch.tensor([[3, 5, 7, 9, 11, 13, 15, 17, 19, 21]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=clean).logits, causal_lm(input_ids=clean).logits)
        got, base = model(input_ids=x).logits, causal_lm(input_ids=x).logits  # [2, 10, V]
    first_mask = (x == M).float().argmax(1)  # a position before the row's first [MASK] sees no adapter
    for b in range(2):
        k = int(first_mask[b])
        assert torch.equal(got[b, :k], base[b, :k])
        assert not torch.allclose(got[b, k:], base[b, k:])  # the [MASK] itself and what attends to it


def test_slots_mask_matches_its_rule():
    valid = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    anchors = torch.tensor([[2, 4, -1]])
    mask = drafting_slots_mask(valid, anchors, 2, torch.float32)[0, 0] == 0  # [6, 6 + 6] keep
    for q in range(6):
        a, t = divmod(q, 2)
        for key in range(12):
            if key < 6:
                want = anchors[0, a] >= 0 and key < anchors[0, a] and bool(valid[0, key])
            else:
                a2, t2 = divmod(key - 6, 2)
                want = (anchors[0, a] >= 0 and a2 == a and t2 <= t) or key - 6 == q
            assert bool(mask[q, key]) == want, (q, key)


def test_loss_equals_each_anchor_decoded_alone(causal_lm):
    settings = _settings()
    model = _random_adapter(causal_lm).double()
    strategy = build_strategy(settings)
    strategy.setup(model, _Tok(), torch.device("cpu"))
    batch = _progressions(3, torch.Generator().manual_seed(7))
    batch["attention_mask"][2, 12:] = 0  # a right-padded row
    batch["loss_mask"][2, 12:] = 0
    batch.update(strategy.corrupt(batch, seeds=[11, 12, 13]))
    got = strategy.loss(model, batch).sums["draft"]
    want, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for b in range(3):
            x, sup = batch["input_ids"][b], batch["loss_mask"][b] != 0
            for k in batch["anchors"][b].tolist():
                if k < 0:
                    continue
                ids = torch.cat([x[:k], torch.full((3,), M)])[None]  # the prefix, then 3 slots
                logp = model(input_ids=ids).logits[0, k:].log_softmax(-1)  # [3, V] a plain causal forward
                for t in range(3):
                    if k + t + 1 < 16 and sup[k + t + 1]:
                        want -= logp[t, x[k + t + 1]]
                        count += 1
    assert count == int(strategy.token_counts(batch)["draft"]) > 0
    assert torch.allclose(got.double(), want, rtol=1e-6)  # per_token_ce takes fp32


@pytest.mark.parametrize(("block_size", "groups"), [(2, 1), (4, 1), (4, 2), (4, 4)])
def test_selfspec_answers_are_the_causal_lms_greedy_ones_in_fewer_forwards(
    causal_lm, drafter, block_size, groups
):
    config = build_sampler_config("ar", {"max_new_tokens": 12})
    ar = SAMPLERS["ar"](causal_lm, _Tok(), config, mask_id=M).generate(PROMPTS)  # the LM alone
    asked = {"max_new_tokens": 12, "block_size": block_size, "slot_groups": groups}
    config = build_sampler_config("selfspec", asked)
    spec = SAMPLERS["selfspec"](drafter, _Tok(), config, mask_id=M).generate(PROMPTS)
    assert spec.sequences == ar.sequences
    assert sum(spec.row_nfe) < sum(ar.row_nfe)
    assert len(spec.draft_fed) == block_size - 1 and spec.draft_accepted[0] > 0
    assert all(a <= f for a, f in zip(spec.draft_accepted, spec.draft_fed))


def test_grouped_slots_draft_from_exactly_the_prefix_the_check_accepted(causal_lm, drafter):
    """With a slot group after each draft (slot_groups = block_size), whatever a check accepts, the next
    forward's drafts are the adapter's guesses from exactly the committed text: the argmax of [MASK] slots
    appended to the prompt and the answer before the pending token, in a plain causal forward of the
    gated model without a cache (the view it was trained on), for every forward after the first."""
    prompt = PROMPTS[0]
    answer = SAMPLERS["ar"](causal_lm, _Tok(), build_sampler_config("ar", {"max_new_tokens": 12}),
                            mask_id=M).generate([prompt]).sequences[0]  # fmt: skip
    fed = []  # (the pending token's position, the drafts after it)

    def record(module, args, kw):
        ids = kw["input_ids"][0].tolist()
        fed.append((int(kw["position_ids"][0, 0]), [t for t in ids[1:] if t != M]))

    hook = drafter.register_forward_pre_hook(record, with_kwargs=True)
    asked = {"max_new_tokens": 12, "block_size": 4, "slot_groups": 4}
    try:
        spec = SAMPLERS["selfspec"](drafter, _Tok(), build_sampler_config("selfspec", asked), mask_id=M)
        assert spec.generate([prompt]).sequences[0] == answer
    finally:
        hook.remove()
    checked = 0
    for pos, drafts in fed[2:]:  # fed[0]: the prompt's forward, fed[1]: drafts from its slots
        before = prompt + answer[: pos - len(prompt)]  # everything before the pending token
        with torch.no_grad():
            logits = drafter(input_ids=torch.tensor([before + [M] * 3])).logits[0, len(before) :]  # [3, V]
        guesses = logits.argmax(-1).tolist()
        assert drafts == guesses[: len(drafts)], (pos, drafts, guesses)
        checked += bool(drafts)
    assert checked >= 2


def test_slot_groups_see_the_drafts_up_to_their_own():
    from dllmflow.diffusion.samplers.selfspec import groups_keep, slot_groups

    assert (
        slot_groups(3, 3, 1) == [3]
        and slot_groups(3, 3, 2) == [0, 3]
        and slot_groups(3, 3, 9) == [0, 1, 2, 3]
    )
    assert slot_groups(0, 3, 4) == [0] and slot_groups(3, 0, 4) == []
    F, W, groups = 2, 2, [0, 2]
    keep = groups_keep(F, W, groups, torch.device("cpu"))  # [7, 7]: pending, d1, d2, then 2 groups of 2
    # the rule written out: position -> the new positions it sees
    sees = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 3}, 4: {0, 3, 4}, 5: {0, 1, 2, 5}, 6: {0, 1, 2, 5, 6}}
    assert {q: set(keep[q].nonzero().flatten().tolist()) for q in range(7)} == sees


def test_an_untrained_adapter_drafts_worse_than_a_trained_one(causal_lm, drafter):
    """The training matters: with a random adapter the same answers take more forwards."""
    config = build_sampler_config("selfspec", {"max_new_tokens": 12, "block_size": 4})
    trained = SAMPLERS["selfspec"](drafter, _Tok(), config, mask_id=M).generate(PROMPTS)
    rand = SAMPLERS["selfspec"](_random_adapter(causal_lm), _Tok(), config, mask_id=M).generate(PROMPTS)
    assert rand.sequences == trained.sequences
    assert sum(trained.row_nfe) < sum(rand.row_nfe)


def test_export_is_the_causal_lm_and_its_adapter_refused_on_other_weights(causal_lm, drafter, tmp_path):
    from transformers import AutoModelForCausalLM

    settings = _settings()
    strategy = build_strategy(settings)
    strategy.mask_token_id = M
    out = tmp_path / "export"
    out.mkdir()
    state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    export_with_lora(strategy.export, drafter, state, _Tok(save_pretrained=lambda d: None), out, settings,
                     merge=strategy.merge_adapters)  # fmt: skip
    info = json.loads((out / DRAFTER_INFO).read_text())
    assert info["base_digest"] == weights_digest(out) and info["block_size"] == 4
    plain = AutoModelForCausalLM.from_pretrained(out).eval()  # transformers alone: the causal LM, unmerged
    x = torch.tensor([PROMPTS[0] + [M, M]])
    with torch.no_grad():
        assert torch.equal(plain(input_ids=x).logits, causal_lm(input_ids=x).logits)
        loaded = load_drafting_adapter(plain, out, out / "adapter")
        assert torch.equal(loaded(input_ids=x).logits, drafter(input_ids=x).logits)
    other = tmp_path / "other"
    AutoModelForCausalLM.from_pretrained(out).apply(_nudge).save_pretrained(other)
    with pytest.raises(UserError, match=r"trained on the causal LM .* but .*other holds other weights"):
        load_drafting_adapter(AutoModelForCausalLM.from_pretrained(other), other, out / "adapter")


def _nudge(module):
    if isinstance(module, torch.nn.Linear):
        module.weight.data[0, 0] += 1e-3


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"peft": None}, "peft"),
        ({"peft": {"r": 8, "modules_to_save": ["lm_head"]}}, "peft.modules_to_save"),
        ({"train": {"activation_checkpointing": "full"}}, "train.activation_checkpointing"),
        (
            {"model": {"pretrained_model_name_or_path": "GSAI-ML/LLaDA-8B-Base"}},
            "model.pretrained_model_name_or_path",
        ),
        ({"eval": {"block_size": 9}}, "eval.block_size"),
    ],
)
def test_bad_settings_fail_at_parse_naming_the_field(over, field):
    base = {"dllm": UNO, "peft": {"r": 8}, "model": TINY}
    with pytest.raises(SettingsError, match=field.replace(".", r"\.")):
        load_settings(**{**base, **over})


def test_a_dllm_export_is_no_base_for_the_adapter(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "dllm": {"mode": "mdlm"}}))
    with pytest.raises(SettingsError, match=r"a dLLM export \(dllm.mode=mdlm\)"):
        load_settings(dllm=UNO, peft={"r": 8}, model={"pretrained_model_name_or_path": str(tmp_path)})


def test_identity_counts_answers_by_id_and_says_when_they_differ():
    from dllmflow.evaluation.control import identical_answers, identity_line

    control = [{"id": "a", "ids": [1, 2, 3]}, {"id": "b", "ids": [4, 5]}, {"id": "c", "ids": [6]}]
    same = identical_answers([{"id": "b", "ids": [4, 5]}, {"id": "a", "ids": [1, 2, 3]}], control)
    assert same == {"identical": 2, "answers": 2}
    assert (
        identity_line({**same, "sampler": "selfspec"})
        == "answers identical to the AR control: 2/2 (selfspec)"
    )
    one_off = identical_answers(
        [{"id": "a", "ids": [1, 2, 4]}, {"id": "c"}], control
    )  # no ids: not identical
    assert one_off == {"identical": 0, "answers": 2}
    line = identity_line({**one_off, "sampler": "selfspec"})
    assert line.startswith("answers NOT identical") and "2 of 2 differ" in line
    assert identity_line({"sampler": "llada"}) is None  # no identity check: nothing claimed


def test_evaluation_metrics_carry_acceptance_per_draft_offset(drafter):
    from dllmflow.evaluation.accuracy import generate_in_batches

    config = build_sampler_config("selfspec", {"max_new_tokens": 12, "block_size": 4})
    runner = SAMPLERS["selfspec"](drafter, _Tok(), config, mask_id=M)
    decoded = generate_in_batches(runner, PROMPTS, [0, 1, 2, 3], 2, "test")
    metrics = decoded.draft_metrics()
    assert set(metrics) == {"draft_acc_k1", "draft_acc_k2", "draft_acc_k3"}
    assert 0 < metrics["draft_acc_k1"] <= 1 and metrics["draft_acc_k3"] <= metrics["draft_acc_k1"]
    whole = runner.generate(PROMPTS)  # one batch: the same checks per row (a row decodes as it would alone)
    assert (decoded.draft_fed, decoded.draft_accepted) == (whole.draft_fed, whole.draft_accepted)


def test_a_lossy_sampler_of_the_adapter_model_runs_and_is_labelled_lossy(drafter):
    from dllmflow.diffusion.modes import decoding_of
    from dllmflow.workflow.card import eval_rows

    assert decoding_of("uno", "selfspec") == decoding_of("uno", "ar") == "lossless"
    assert decoding_of("uno", "llada2") == "lossy"
    assert decoding_of("mdlm", "llada2") is None  # no causal LM to be lossless to: no label
    config = build_sampler_config(
        "llada2", {"max_new_tokens": 8, "block_size": 4, "steps": 4, "threshold": 0.5}
    )
    assert len(SAMPLERS["llada2"](drafter, _Tok(), config, mask_id=M).generate(PROMPTS).sequences) == 4
    rows = eval_rows({"llada2": {"metrics": {}, "protocol": {"decoding": "lossy"}},
                      "selfspec": {"metrics": {}, "protocol": {"decoding": "lossless"}}})  # fmt: skip
    assert [r[0] for r in rows] == ["llada2 (lossy)", "selfspec"]
