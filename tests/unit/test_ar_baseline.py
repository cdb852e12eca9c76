"""The AR baseline (`eval.ar_baseline`, evaluation/ar_baseline.py) and the A2D recipes' task
(`embedded:arithmetic`, data/synthetic.py): greedy decoding equals a step-by-step argmax of plain
forwards; the flow runs `ar` beside the samplers and the results table, the card and MLflow show it.
A tiny random Qwen3 on a few held-out problems; no SmolLM2 weights are loaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from dllmflow.data.chat import load_chat_rows
from dllmflow.data.synthetic import addition_rows, arithmetic_rows
from dllmflow.data.task import gold_answer
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_RECIPES = ("smollm2_mdlm", "smollm2_mdlm_lora", "smollm2_idlm", "smollm2_idlm_lora")


# ---- the task ------------------------------------------------------------------------------------


def test_addition_rows_are_unchanged():
    # The demo and the golden tests were measured on these exact rows (sha256 of the rows as first shipped).
    digest = hashlib.sha256(json.dumps(addition_rows()).encode()).hexdigest()
    assert digest == "8371b11f970fc5cb61a63f1fd9f846048fb174e503f6cbc8c0236389fba4601e"


def test_arithmetic_rows_answer_right_at_a_fixed_width():
    rows = arithmetic_rows(num_rows=400, seed=3)
    assert rows == arithmetic_rows(num_rows=400, seed=3) and rows != arithmetic_rows(num_rows=400, seed=4)
    questions = [r["messages"][0]["content"] for r in rows]
    assert len(set(questions)) == 400 and {"+", "-"} == {q.split()[3] for q in questions}
    assert (
        {len(q.split()[2]) for q in questions} == {len(q.split()[4].rstrip("?")) for q in questions} == {1, 2}
    )
    for r in rows:
        a, op, b = r["messages"][0]["content"].removeprefix("What is ").rstrip("?").split()
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert expected >= 0 and gold_answer(r["messages"][1]["content"]) == str(expected)
        assert len(r["messages"][1]["content"]) == len("#### 045")  # max_digits + 1 digits, zero-padded
    with pytest.raises(ValueError, match="distinct"):
        arithmetic_rows(num_rows=101, min_digits=1, max_digits=1, ops="+")  # only 10 x 10 problems
    src = load_chat_rows("embedded:arithmetic")
    assert src.files == ["embedded:arithmetic"] and len(src.rows) == 4000 and src.rows[:400] != rows


# ---- greedy decoding ------------------------------------------------------------------------------


def _reference_greedy(model, prompt: list[int], n: int, stop: set[int]) -> list[int]:
    """Argmax of a full causal forward over the unpadded sequence, one token at a time (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if nxt in stop:
            break
        ids.append(nxt)
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from dllmflow.data.prepare import prepare

    tmp = tmp_path_factory.mktemp("ar")
    s = load_settings(
        ROOT / "params" / "tiny_addition.yaml",
        dataset={"prepared_dir": str(tmp / "prepared"), "limit": 64},
        eval={
            "limit": 5,
            "max_new_tokens": 6,
            "batch_size": 4,
            "ar_baseline": True,
            "sweep": None,
            "ar_control": None,
        },
        run_dir=str(tmp / "run"),
    )
    prepare(s)
    return s


def test_the_ar_sampler_on_the_base_equals_a_step_by_step_argmax(prepared):
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.evaluation.ar_baseline import build_ar_base, build_ar_sampler

    tok = load_tokenizer(prepared.dataset.prepared_dir)
    model = build_ar_base(prepared, tok, device="cpu")
    prompts = [tok.encode("What is 12 + 7?"), tok.encode("What is 345 + 678 + 9?"), tok.encode("Hi")]
    assert len({len(p) for p in prompts}) == 3  # three widths: left padding is exercised
    runner = build_ar_sampler(model, tok, max_new_tokens=6)
    out = runner.generate(prompts)
    assert out.sequences == [_reference_greedy(model, p, 6, runner.stop_ids) for p in prompts]
    # a row's forwards: its answer and the stop id ending it (none when it ran to max_new_tokens)
    assert out.row_nfe == [min(len(s) + 1, 6) for s in out.sequences] and out.nfe == max(out.row_nfe)
    assert out.num_generated_tokens == sum(map(len, out.sequences))


def test_the_flow_evaluates_ar_beside_the_samplers(prepared, tmp_path):
    from dllmflow.evaluation.ar_baseline import AR_EVALUATION
    from dllmflow.workflow import card, finetune

    assert finetune.AR_EVALUATION == AR_EVALUATION
    assert finetune.eval_samplers(prepared)[-1] == "ar"
    assert "ar" not in finetune.eval_samplers(load_settings(ROOT / "params" / "tiny_mdlm.yaml"))
    assert finetune.eval_samplers(load_settings(ROOT / "params" / "tiny_addition.yaml"))[-2:] == [
        "ar",
        "ar_control",
    ]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = finetune.evaluate_sampler(prepared, str(run_dir), "ar")  # the base model: no checkpoint needed
    assert json.loads((run_dir / "eval" / "ar.json").read_text())["metrics"] == result["metrics"]
    assert result["protocol"]["sampler"] == "ar" and result["model"].startswith("AR base: untrained tiny")
    assert result["metrics"]["num_examples"] == 5 and len(result["predictions"]) == 5
    held = [r["messages"][0]["content"] for r in load_chat_rows("embedded:addition").rows]
    assert {p["prompt"] for p in result["predictions"]} <= set(held)  # held-out questions, asked as is
    assert {"exact_match_strict", "exact_match_flexible", "tokens_per_s", "nfe"} <= set(result["metrics"])

    evals = {
        "llada": {"metrics": {"exact_match_flexible": 0.9, "num_examples": 5, "tokens_per_s": 50.0},
                  "baseline": {"metrics": {"exact_match_flexible": 0.1}, "model": "converted, before"}},
        "ar": {"metrics": {"exact_match_flexible": 0.4, "num_examples": 5, "tokens_per_s": 80.0, "nfe": 6.0}},
    }  # fmt: skip
    text = finetune.results_table(evals)
    header = next(line for line in text.splitlines() if "sampler" in line)
    assert [c.strip() for c in header.split("┃")[2:6]] == ["examples", "EM AR", "EM before", "EM after"]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.splitlines() if line.count("│") > 4}  # fmt: skip
    assert rows["llada"][:5] == ["5", "0.400", "0.100", "0.900", "50"]
    assert rows["ar (untrained)"][:5] == ["5", "0.400", "-", "-", "80"]  # the AR control's "before"
    headers, table = card.before_after_rows(evals)
    assert headers[1:] == ["exact match AR base (greedy)", "before: converted, before", "after fine-tuning"]
    assert table == [["llada", "0.4", "0.1", "0.9"]]
    assert card.before_after_rows({"llada": {"metrics": {}}}) == ([], [])


@pytest.mark.parametrize("name", SMOLLM2_RECIPES)
def test_smollm2_recipes_measure_ar_before_and_after_on_one_task(name):
    s = load_settings(ROOT / "params" / f"{name}.yaml")
    assert s.eval.ar_baseline and s.eval.untrained_baseline and s.model.tiny is None
    assert s.dataset.path_or_dataset_id == "embedded:arithmetic"
    first = load_settings(ROOT / "params" / f"{SMOLLM2_RECIPES[0]}.yaml")
    assert (s.dataset, s.tokenizer, s.eval.limit) == (first.dataset, first.tokenizer, first.eval.limit)
