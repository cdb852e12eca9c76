"""`dllmflow.workflow.card`: the card of a finetune run built from a fake run dir (metrics.jsonl and an
eval JSON): the tables hold the run's numbers, the figures plot them, lineage names the gate decision."""

from __future__ import annotations

import base64
import json
import re
from types import SimpleNamespace

import pytest

from dllmflow.settings import load_settings
from dllmflow.workflow.card import (
    build_card_components,
    eval_chart,
    eval_rows,
    loss_chart,
    sample_row,
    sweep_chart,
)

LOSSES = [5.0, 4.25, 3.5]


@pytest.fixture()
def run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": i + 1, "loss": v, "dllm_loss": v - 0.5}) for i, v in enumerate(LOSSES))
        + '\n{"step": 4, "lo'  # a torn last line is skipped
    )
    evals = {
        "llada": {
            "metrics": {"exact_match_strict": 0.25, "exact_match_flexible": 0.375, "tokens_per_s": 123.456,
                        "nfe": 16, "tokens_per_forward": 2.0},
            # the keys evaluation.accuracy.evaluate writes
            "predictions": [{"id": "eval-7", "prompt": "What is 2 + 3?", "prediction": "It is   5.", "answer": "5",
                             "correct_flexible": True}] * 4,
        },
        "acceptance": {"metrics": {"tokens_per_s": 10.0, "tau": 3.25}},
    }  # fmt: skip
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "llada.json").write_text(json.dumps(evals["llada"]))
    evals_from_disk = {
        "llada": json.loads((tmp_path / "eval" / "llada.json").read_text()),
        **{"acceptance": evals["acceptance"]},
    }
    return tmp_path, evals_from_disk


def _rendered(parts):
    return [p.render() for p in parts]


def test_eval_rows_format_every_column():
    rows = eval_rows({"s": {"metrics": {"exact_match_strict": 0.5, "tokens_per_s": 1234.5678, "nfe": 8}}})
    assert rows == [["s", "0.5", "-", "1235", "8", "-", "-"]]


def test_loss_chart_plots_the_logged_curves(run):
    run_dir, _ = run
    spec = loss_chart(str(run_dir))
    values = spec["data"]["values"]
    curve = {
        name: [(v["step"], v["loss"]) for v in values if v["curve"] == name] for name in ("loss", "dllm_loss")
    }
    assert curve["loss"] == list(zip([1, 2, 3], LOSSES))
    assert curve["dllm_loss"] == [(s, v - 0.5) for s, v in zip([1, 2, 3], LOSSES)]
    assert spec["encoding"]["color"]["field"] == "curve" and spec["mark"]["type"] == "line"


def test_eval_chart_has_one_labelled_point_per_sampler():
    spec = eval_chart({"llada": {"metrics": {"tokens_per_s": 120.0, "exact_match_flexible": 0.25}}, "x": {}})
    assert spec["data"]["values"] == [
        {"sampler": "llada", "tokens_per_s": 120.0, "exact_match_flexible": 0.25},
        {"sampler": "x", "tokens_per_s": 0.0, "exact_match_flexible": 0.0},
    ]
    assert [layer["mark"]["type"] for layer in spec["layer"]] == ["point", "text"]


def test_card_components_hold_the_numbers(run):
    run_dir, evals = run
    settings = load_settings(name="card-test", dllm={"mode": "mdlm"})
    data = {"content_hash": "c0ffee" * 4, "dvc_stage": "prepare", "dvc_rev": "abc123"}
    training = {"app_handle": "local_cwd://torchx/app-1"}
    registration = {
        "run_id": "r-42", "model_name": "m", "version": 3, "gate_promoted": False,
        "gate_reason": "exact_match_flexible 0.3750 < champion v2 0.5000 - 0.0", "lineage": {"git_sha": "deadbeef"},
    }  # fmt: skip
    parts = _rendered(build_card_components(settings, str(run_dir), evals, data, training, registration))
    assert parts[0] == {**parts[0], "type": "markdown", "source": "# card-test: `mdlm` fine-tune"}
    tables = [p for p in parts if p["type"] == "table"]
    evals_table, samples, lineage = tables
    assert evals_table["columns"] == [
        "sampler", "exact_match_strict", "exact_match_flexible", "tokens_per_s", "nfe", "tokens_per_forward", "tau",
    ]  # fmt: skip
    assert evals_table["data"] == [
        ["llada", "0.25", "0.375", "123.5", "16", "2", "-"],
        ["acceptance", "-", "-", "10", "-", "-", "3.25"],  # DFlash: tau from evaluate_dflash
    ]
    # three samples per sampler, whitespace collapsed
    assert samples["data"] == [["llada", "What is 2 + 3?", "It is 5.", "5"]] * 3
    lineage_rows = dict(map(tuple, lineage["data"]))
    assert lineage_rows["data content hash"] == data["content_hash"]
    assert lineage_rows["DVC stage / rev"] == "prepare / abc123"
    assert lineage_rows["torchx app"] == "local_cwd://torchx/app-1"
    assert lineage_rows["MLflow run"] == "r-42" and lineage_rows["model version"] == "m v3"
    assert lineage_rows["gate"] == "rejected: " + registration["gate_reason"]
    assert lineage_rows["git sha"] == "deadbeef"
    assert sum(p["type"] == "vegaChart" for p in parts) == 2  # loss curve, accuracy vs speed


def test_card_without_evaluations_has_no_eval_figure_or_samples(run):
    run_dir, _ = run
    parts = _rendered(
        build_card_components(load_settings(), str(run_dir), {}, {}, {}, {"gate_promoted": True})
    )
    tables = [p for p in parts if p["type"] == "table"]
    assert len(tables) == 2 and tables[0]["data"] in ([], [[]])  # metaflow renders no rows as [[]]
    assert dict(map(tuple, tables[1]["data"]))["gate"] == "promoted: None"
    assert sum(p["type"] == "vegaChart" for p in parts) == 1


def _card_html_data(parts) -> str:
    """The card as the flow's `@card(type="blank")` renders it (HTML), decoded to its JSON payload."""
    from metaflow.plugins.cards.card_modules.basic import BlankCard

    html = BlankCard(components=parts).render(SimpleNamespace(pathspec="FinetuneFlow/1/end/3"))
    assert html.lstrip().lower().startswith("<!doctype html") or "<html" in html.lower()
    m = re.search(r'__MF_DATA__\["[^"]+"\] = "([^"]+)"', html)
    return base64.b64decode(m.group(1)).decode()


def _tables_in(node):
    if isinstance(node, dict):
        if node.get("type") == "table":
            yield node
        for v in node.values():
            yield from _tables_in(v)
    elif isinstance(node, list):
        for v in node:
            yield from _tables_in(v)


def test_card_html_sample_columns_hold_prompt_generation_reference(run):
    run_dir, evals = run
    parts = build_card_components(load_settings(), str(run_dir), evals, {}, {}, {"gate_promoted": True})
    payload = json.loads(_card_html_data(parts))
    samples = next(t for t in _tables_in(payload) if t.get("columns", [None])[1:2] == ["prompt"])
    assert samples["columns"] == ["sampler", "prompt", "generation", "reference"]
    for row in samples["data"]:
        sampler, prompt, generation, reference = row
        assert (sampler, prompt, generation, reference) == ("llada", "What is 2 + 3?", "It is 5.", "5")


def test_sample_row_reads_what_evaluate_writes_and_older_eval_files():
    assert sample_row("llada", {"id": "eval-1", "prediction": "#### 7", "answer": "7"}) == [
        "llada",
        "eval-1",
        "#### 7",
        "7",
    ]  # an eval JSON from before `prompt` was recorded: the row id stands in
    assert sample_row("s", {"prompt": "q", "prediction": "a", "answer_number": 3})[3] == "3"
    assert sample_row("s", {"prompt": "q", "prediction": "a", "answer": None})[3] == ""


SWEEP = {
    "grid": {"threshold": [None, 0.9]}, "metric": "exact_match_flexible", "tolerance": 0.01, "pareto": [0, 1],
    "chosen": 1,
    "points": [
        {"setting": {"threshold": None}, "metrics": {"exact_match_flexible": 0.5, "tokens_per_s": 100.0, "nfe": 8}},
        {"setting": {"threshold": 0.9}, "metrics": {"exact_match_flexible": 0.495, "tokens_per_s": 300.0, "nfe": 3}},
    ],
}  # fmt: skip


def test_sweep_chart_plots_exact_match_against_speed_per_setting_and_marks_front_and_choice():
    assert sweep_chart({"llada": {"metrics": {}}}) is None  # no sweep, no chart
    spec = sweep_chart({"llada": {"metrics": {}, "sweep": SWEEP}})
    assert (
        spec["encoding"]["x"]["field"] == "tokens_per_s" and spec["encoding"]["y"]["field"] == "exact_match"
    )
    assert [(v["setting"], v["exact_match"], v["tokens_per_s"], v["pareto"], v["chosen"])
            for v in spec["data"]["values"]] == [
        ("threshold=None", 0.5, 100.0, True, False), ("threshold=0.9", 0.495, 300.0, True, True),
    ]  # fmt: skip


def test_card_with_a_sweep_has_its_chart_and_table(run):
    run_dir, evals = run
    evals["llada"]["sweep"] = SWEEP
    parts = _rendered(build_card_components(load_settings(), str(run_dir), evals, {}, {}, {}))
    assert sum(p["type"] == "vegaChart" for p in parts) == 3  # loss, per sampler, per setting
    sweep_table = next(p for p in parts if p["type"] == "table" and "setting" in p["columns"])
    assert sweep_table["data"] == [
        ["llada", "threshold=None", "0.5", "100", "8", "yes", ""],
        ["llada", "threshold=0.9", "0.495", "300", "3", "yes", "chosen"],
    ]
