"""Rewards (docs/strategies.md §8.3): built-ins on real rows of the bundled tasks, user rewards from the
caller's recipe only, and failing rewards reported per row instead of trained on."""

from __future__ import annotations

import pytest
import torch

from dllmflow.data.gsm8k import load_gsm8k_rows
from dllmflow.data.synthetic import addition_rows
from dllmflow.errors import UserError
from dllmflow.rl.rewards import build_rewards, score


def _qa(row):
    return row["messages"][0]["content"], row["messages"][-1]["content"]


def test_exact_match_and_format_on_addition_rows():
    (em,) = build_rewards(["exact_match"], None, import_user=False)
    (fmt,) = build_rewards(["format"], None, import_user=False)
    for row in addition_rows(num_rows=5):
        q, a = _qa(row)  # "What is 47 + 38?", "#### 085"
        total = int(a.split()[-1])
        assert em.fn(q, a, a) == 1.0 and fmt.fn(q, a, a) == 1.0
        assert em.fn(q, f"#### {total + 1:03d}", a) == 0.0  # a wrong sum, well formatted
        assert fmt.fn(q, f"#### {total + 1:03d}", a) == 1.0
        assert em.fn(q, f"{total}", a) == 1.0 and fmt.fn(q, f"{total}", a) == 0.0  # right, unformatted
        assert em.fn(q, "#### ", a) == 0.0 and fmt.fn(q, "#### ", a) == 0.0


def test_exact_match_and_format_on_gsm8k_rows():
    em, fmt = build_rewards(["exact_match", "format"], None, import_user=False)
    for row in load_gsm8k_rows()[:5]:
        q, a = _qa(row)
        assert em.fn(q, a, a) == 1.0 and fmt.fn(q, a, a) == 1.0
        reasoning = a.rsplit("####", 1)[0].strip()
        assert fmt.fn(q, reasoning, a) == 0.0
        assert em.fn(q, reasoning + "\n#### 1,000,001", a) == 0.0


def _raises(prompt, completion, answer):
    raise ValueError("bad row")


def _nan(prompt, completion, answer):
    return float("nan") if "2" in prompt else 1.0


def _text(prompt, completion, answer):
    return "high" if "3" in prompt else 0.5


def test_failing_rewards_are_flagged_and_the_rest_scored(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("rl_test_rewards")
    mod.raises, mod.nan, mod.text = _raises, _nan, _text
    monkeypatch.setitem(sys.modules, "rl_test_rewards", mod)
    prompts = ["q1", "q2", "q3", "q4"]
    completions = ["#### 1", "#### 2", "#### 3", "#### 5"]
    answers = ["#### 1", "#### 2", "#### 3", "#### 4"]
    rewards = build_rewards(["exact_match", "rl_test_rewards:nan", "rl_test_rewards:text"], [1.0, 0.5, 2.0],
                            import_user=True)  # fmt: skip
    batch = score(rewards, prompts, completions, answers)
    assert batch.valid.tolist() == [True, False, False, True]
    assert torch.equal(batch.values, torch.tensor([1.0 + 0.5 + 1.0, 0.0, 0.0, 0.0 + 0.5 + 1.0]))
    assert [(f.index, f.prompt, f.reward) for f in batch.failures] == [
        (1, "q2", "rl_test_rewards:nan"), (2, "q3", "rl_test_rewards:text")]  # fmt: skip
    assert "nan" in batch.failures[0].error and "str" in batch.failures[1].error
    raising = score(
        build_rewards(["rl_test_rewards:raises", "format"], None, True), prompts, completions, answers
    )
    assert not raising.valid.any() and torch.equal(raising.values, torch.zeros(4))
    assert len(raising.failures) == 4 and "ValueError: bad row" in raising.failures[0].error


def test_user_rewards_only_from_the_callers_recipe():
    with pytest.raises(UserError, match=r"rl\.rewards.*user reward"):
        build_rewards(["dllmflow.rl.rewards:answer_format"], None, import_user=False)
    (r,) = build_rewards(["dllmflow.rl.rewards:answer_format"], [2.0], import_user=True)
    assert r.weight == 2.0 and r.fn("q", "#### 3", "3") == 1.0
    with pytest.raises(UserError, match=r"rl\.rewards.*exact_match"):
        build_rewards(["exactmatch"], None, import_user=True)
    with pytest.raises(UserError, match="rl.rewards: cannot load"):
        build_rewards(["no_such_module_x:fn"], None, import_user=True)
    with pytest.raises(UserError, match="rl.reward_weights"):
        build_rewards(["format"], [1.0, 2.0], import_user=True)


def test_rewards_passed_in_code_need_no_import():
    """`GRPOTrainer(..., rewards=[fn])`: a callable is taken as is (named by its own name), beside names."""

    def brevity(prompt, completion, answer):
        return 1.0 / (1 + len(completion))

    rewards = build_rewards([brevity, "format"], [2.0, 1.0], import_user=False)
    assert [r.name for r in rewards] == ["brevity", "format"]
    batch = score(rewards, ["q", "q"], ["#### 7", "abc"], ["#### 7", "#### 7"])
    assert batch.values.tolist() == pytest.approx([2.0 / 7 + 1.0, 2.0 / 4])
