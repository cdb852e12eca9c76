"""The AR control arm (`eval.ar_control`: settings, workflow/ar_control.py, evaluation/control.py, the
registry's control rule): refused at parse time where it cannot run, trained from the run's own settings,
compared only under one protocol, shown side by side. The flow itself: tests/e2e/test_finetune_flow.py
(the idlm case) and test_workflow.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllmflow.evaluation.control import ProtocolMismatchError, compare_arms
from dllmflow.evaluation.protocol import EvalProtocol
from dllmflow.runs import run_training, training_summary
from dllmflow.settings import SettingsError, load_settings
from dllmflow.tracking.registry import control_decision, control_tags
from dllmflow.workflow import ar_control
from dllmflow.workflow.card import comparison_table, results_table

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "params" / "tiny_addition.yaml"


# ---- settings: refused at parse time ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "overrides", "match"),
    [
        (DEMO, {"eval": {"ar_control": {"steps": 0}}}, r"eval.ar_control.steps: 0 steps leave the AR control untrained"),
        (DEMO, {"eval": {"ar_control": {"max_em_gap": -0.1}}}, r"eval.ar_control.max_em_gap"),
        ("tiny_block_diffusion.yaml", {"eval": {"ar_control": {}}},
         r"eval.ar_control cannot run with dllm.mode=block_diffusion: DiffusionGemma is an encoder-decoder"),
        ("tiny_dflash.yaml", {"eval": {"ar_control": {}}}, r"eval.ar_control cannot run with dllm.mode=dflash"),
        ("tiny_ar.yaml", {"eval": {"ar_control": {}}}, r"dllm.mode=ar: the run is already the AR model"),
        ("tiny_ar.yaml", {"eval": {"ar_baseline": True}}, r"eval.ar_baseline: dllm.mode=ar is the AR model itself"),
        (DEMO, {"model": {"tiny": None, "pretrained_model_name_or_path": "GSAI-ML/LLaDA-8B-Base"},
                "eval": {"ar_control": {}}}, r"eval.ar_control: model.pretrained_model_name_or_path .* non-causal llada"),
        (DEMO, {"model": {"remote_dir": "s3://b/runs/x"}},
         r"model.remote_dir: names where a run's export is mirrored; set model.pretrained_model_name_or_path"),
    ],
)  # fmt: skip
def test_a_control_that_cannot_run_is_refused_at_parse_time(recipe, overrides, match):
    path = recipe if isinstance(recipe, Path) else ROOT / "params" / recipe
    with pytest.raises(SettingsError, match=match):
        load_settings(path, **overrides)


def test_a_local_base_is_judged_by_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llada"}))
    base = {"tiny": None, "pretrained_model_name_or_path": str(tmp_path)}
    with pytest.raises(SettingsError, match="non-causal llada"):
        load_settings(DEMO, model=base, eval={"ar_control": {}})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert load_settings(DEMO, model=base, eval={"ar_control": {}}).eval.ar_control.enabled
    assert (
        load_settings(DEMO, eval={"ar_control": {"enabled": False}}).eval.ar_control.check(None, None) is None
    )


# ---- the control's settings: the run's, trained causally ---------------------------------------------------


def test_the_control_trains_on_the_runs_rows_with_its_optimizer_and_budget(tmp_path):
    s = load_settings(ROOT / "params" / "tiny_idlm.yaml", eval={"ar_control": {}, "cache": None},
                      dataset={"prepared_dir": str(tmp_path / "prep")})  # fmt: skip
    flow = tmp_path / "runs" / "flow-7"
    c = ar_control.control_settings(s, flow / "stage_1")  # a curriculum's last stage: the control sits beside
    assert c.dllm.mode == "ar" and c.dllm.mask_token_id == s.dllm.mask_token_id == 2
    assert c.run_dir == str(flow / "ar_control") == str(ar_control.control_dir(flow))
    assert (c.train, c.model, c.dataset, c.tokenizer, c.launch) == (
        s.train,
        s.model,
        s.dataset,
        s.tokenizer,
        s.launch,
    )
    assert (c.eval.limit, c.eval.max_new_tokens, c.eval.batch_size, c.eval.split) == (
        s.eval.limit, s.eval.max_new_tokens, s.eval.batch_size, s.eval.split)  # fmt: skip
    assert c.eval.ar_control is None and not c.eval.ar_baseline
    # of the eval section only the fields it lists: a dLLM sampler's knob does not reach the control
    knobs = s.model_copy(update={"eval": s.eval.model_copy(update={"threshold": 0.9, "steps": 4})})
    c = ar_control.control_settings(knobs, flow)
    assert (c.eval.threshold, c.eval.steps, c.eval.samplers, c.eval.sweep) == (None, None, None, None)
    kept = set(ar_control.CONTROL_EVAL)
    assert {k: v for k, v in c.eval.model_dump().items() if k in kept} == {
        k: v for k, v in s.eval.model_dump().items() if k in kept}  # fmt: skip
    more = s.model_copy(update={"eval": s.eval.model_copy(update={"ar_control": s.eval.ar_control.model_copy(
        update={"steps": 80})})})  # fmt: skip
    assert ar_control.control_settings(more, flow).train.max_steps == 80 != s.train.max_steps


def test_training_summary_adds_the_steps_records(tmp_path):
    records = [
        {"step": i, "tokens_per_step": 100 * i, "supervised_tokens": 10 * i, "tps": 50.0 * i}
        for i in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert training_summary(tmp_path) == {"train_steps": 3, "train_tokens": 600, "train_supervised_tokens": 60,
                                          "train_seconds": pytest.approx(3 * 2.0)}  # fmt: skip
    (tmp_path / "stage_0").mkdir()
    (tmp_path / "stage_1").mkdir()
    for stage in ("stage_0", "stage_1"):
        (tmp_path / stage / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    assert run_training(tmp_path / "stage_1")["train_tokens"] == 200  # both stages


# ---- one protocol for both arms ------------------------------------------------------------------------


def _result(em: float, **protocol) -> dict:
    base = {"prepared_dir": "data/p", "split": "eval", "limit": 64, "n_shot": 0, "max_new_tokens": 8,
            "chat_template_sha256": "t", "prompts_sha256": "p", "answer_parser": "gsm8k", "batch_size": 64,
            "split_sha256": "s"}  # fmt: skip
    return {"metrics": {"exact_match_flexible": em, "latency_s_b1": 0.02, "tokens_per_s_b16": 300.0},
            "training": {"train_steps": 10, "train_tokens": 640, "train_seconds": 3.0},
            "protocol": {**base, **protocol}}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [("limit", 32), ("prompts_sha256", "other prompts"), ("answer_parser", "last line"), ("split", "train"),
     ("max_new_tokens", 16), ("n_shot", 1), ("chat_template_sha256", "u"), ("prepared_dir", "data/q"),
     ("split_sha256", "other rows")],
)  # fmt: skip
def test_arms_asked_or_scored_differently_are_refused(field, value):
    with pytest.raises(
        ProtocolMismatchError, match=rf"llada and ar_control were not evaluated alike \({field}:"
    ):
        compare_arms("llada", _result(0.9), _result(0.8, **{field: value}))
    assert field in EvalProtocol.ARMS and "sampler" not in EvalProtocol.ARMS  # the arms' samplers differ


def test_the_side_by_side_and_its_gap():
    side = compare_arms(
        "llada", _result(0.75), _result(0.8, batch_size=8)
    )  # a batch size is not the protocol
    assert side["em_gap"] == pytest.approx(-0.05) and side["dllm"]["latency_s_b1"] == 0.02
    assert side["ar_control"]["train_tokens"] == 640
    text = comparison_table(side)
    rows = {
        ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]]
        for ln in text.splitlines()
        if "│" in ln
    }
    assert rows["dLLM (llada)"] == ["0.750", "0.020", "300", "10", "640", "3.0"]
    assert rows["AR control (ar)"][0] == "0.800" and text.endswith("EM gap (dLLM - AR control): -0.050")
    tags = control_tags(side)
    assert tags["control.dllm.exact_match_flexible"] == "0.75" and tags["control.em_gap"] == "-0.050000"


def test_the_gate_can_require_the_dllm_within_x_of_the_control():
    side = compare_arms("llada", _result(0.75), _result(0.8))
    assert control_decision(True, "ok", side, None) == (True, "ok")  # reported, not gated
    assert control_decision(False, "below the floor", side, 0.0) == (False, "below the floor")
    ok, reason = control_decision(True, "ok", side, 0.06)
    assert ok and reason == "ok; dLLM EM 0.7500 >= AR control EM 0.8000 - 0.06 (eval.ar_control.max_em_gap)"
    ok, reason = control_decision(True, "ok", side, 0.04)
    assert not ok and reason == "dLLM EM 0.7500 < AR control EM 0.8000 - 0.04 (eval.ar_control.max_em_gap)"


def test_the_results_table_labels_the_untrained_base_as_the_controls_before():
    evals = {"llada": _result(0.9), "ar": _result(0.1), "ar_control": _result(0.8)}
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]]
            for ln in results_table(evals).splitlines() if ln.count("│") > 4}  # fmt: skip
    # examples, EM AR, EM before, EM after
    assert rows["ar (untrained)"][1:4] == ["0.100", "-", "-"]
    assert rows["ar_control"][1:4] == ["0.100", "0.100", "0.800"]
    assert rows["llada"][3] == "0.900"
