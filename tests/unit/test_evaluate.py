"""GSM8K answer extraction (strict / flexible, commas and $ ignored) and one `evaluate` run on a tiny
prepared dataset + random checkpoint: metrics agree with the predictions, the protocol is recorded."""

from __future__ import annotations

import json

import pytest
from _tiny_eval import tiny_eval_export

from dllmflow.cli import main
from dllmflow.data.task import (
    gold_answer,
    gsm8k_extract_flexible,
    gsm8k_extract_strict,
    normalize_number,
    prompt_messages,
)
from dllmflow.evaluation.accuracy import evaluate


@pytest.mark.parametrize(
    "text,strict,flexible",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
        ("Total is $1,234.\n#### $1,234", "1234", "1234"),
        ("#### 1,000,000 and then 5 more", "1000000", "5"),
        ("The answer is 42.", None, "42"),
        ("It costs $18.00 in total", None, "18"),
        ("#### -3", "-3", "-3"),
        ("I earned 2.5 dollars, then 3 dollars", None, "3"),
        ("#### 0.50", "0.5", "0.5"),
        ("no number here", None, None),
        ("####", None, None),
    ],
)
def test_extractors(text, strict, flexible):
    assert gsm8k_extract_strict(text) == strict
    assert gsm8k_extract_flexible(text) == flexible


def test_strict_takes_the_answer_line_not_the_last_number():
    text = "#### 12\nThen 5 apples were left over."
    assert gsm8k_extract_strict(text) == "12" and gsm8k_extract_flexible(text) == "5"


def test_normalize_and_gold():
    assert normalize_number("$1,234.") == "1234"
    assert normalize_number("7.250") == "7.25"
    assert normalize_number("abc") is None
    assert gold_answer("Half of 48 is 24.\n#### 24") == "24"
    assert gold_answer("The answer is 1,500") == "1500"


def test_prompt_messages_drop_the_reference_answer():
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a #### 1"}]
    assert prompt_messages(chat) == chat[:1]
    shot = [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "#### 0"}]
    assert prompt_messages(chat, [shot]) == shot + chat[:1]


# ---- a real (tiny) evaluation -------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_eval_export(tmp_path_factory.mktemp("eval"))


def test_evaluate_records_metrics_protocol_predictions(setup):
    ckpt, _ = setup
    res = evaluate(ckpt, overrides={"threshold": 0.9})  # settings from the checkpoint's settings.json
    m, proto, preds = res["metrics"], res["protocol"], res["predictions"]
    assert m["num_examples"] == len(preds) == 3  # settings.eval.limit
    assert m["exact_match_strict"] == sum(p["correct_strict"] for p in preds) / 3
    assert m["exact_match_flexible"] == sum(p["correct_flexible"] for p in preds) / 3
    assert all(p["answer"] is not None and "," not in p["answer"] for p in preds)
    assert 1 <= m["nfe"] <= 4 and m["tokens_per_s"] >= 0 and m["tokens_per_forward"] >= 0
    # per answer: its forwards and positions; the ratio over all answers is tokens / positions
    assert m["nfe"] == sum(p["nfe"] for p in preds) / 3 and all(p["positions"] > 0 for p in preds)
    tokens = sum(p["num_tokens"] for p in preds)
    assert m["effective_token_ratio"] == tokens / sum(p["positions"] for p in preds)
    assert all(p["effective_token_ratio"] == p["num_tokens"] / p["positions"] for p in preds)
    assert proto["sampler"] == "llada" and proto["split"] == "eval" and proto["limit"] == 3
    s = proto["sampler_settings"]
    assert (s["max_new_tokens"], s["steps"], s["threshold"], s["block_size"]) == (8, 4, 0.9, 128)
    assert proto["n_shot"] == 0 and len(proto["chat_template_sha256"]) == 16 and proto["seed"] == 0


def test_evaluate_cli_writes_results(setup, tmp_path, capsys):
    ckpt, _ = setup
    out = tmp_path / "results.json"
    code = main(["evaluate", "--checkpoint", str(ckpt), "--limit", "2", "--output", str(out), "--steps", "2"])
    assert code == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["metrics"]["num_examples"] == 2 and res["protocol"]["sampler_settings"]["steps"] == 2
    assert "exact_match_strict" in capsys.readouterr().out
    args = ["evaluate", "--checkpoint", str(ckpt), "--limit", "1", "--output", str(out), "--eos-truncate"]
    assert main(args + ["--eos-token-id", "tokenizer"]) == 0, capsys.readouterr().err
    s = json.loads(out.read_text())["protocol"]["sampler_settings"]
    assert s["eos_truncate"] is True and isinstance(s["eos_token_id"], int)
    assert main(["evaluate", "--checkpoint", str(ckpt), "--sampler", "nope"]) == 2
