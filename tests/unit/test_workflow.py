"""`dllmflow.workflow.finetune`, the library side of the flow steps, called directly: the Config
parser and its errors, run-time parameters, the run dir of a flow run, the evaluation matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dllmflow.errors import UserError
from dllmflow.settings import Settings, SettingsError, load_settings
from dllmflow.workflow.finetune import eval_samplers, flow_run_dir, parse_params_config, resolve_flow_settings

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "params" / "tiny_mdlm.yaml"


# ---- start: the Config parser ------------------------------------------------------------------------


def test_parse_params_config_fills_defaults_and_keeps_the_recipe():
    config = parse_params_config(TINY.read_text())
    raw = yaml.safe_load(TINY.read_text())
    assert config["name"] == "tiny_mdlm" and config["train"]["lr"] == raw["train"]["lr"]
    assert config["train"]["max_steps"] == 600 and config["dllm"]["mode"] == "mdlm"
    assert config["train"]["seed"] == 42  # not in the recipe: the default is filled in
    assert config == load_settings(TINY).to_dict()


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("train: {lrr: 1}\n", ("train.lrr", "--config recipe")),
        ("train: {lr: fast}\n", ("train.lr", "--config recipe")),
        ("train: [1, 2\n", ("invalid YAML", "--config recipe")),
        ("- a\n", ("mapping", "--config recipe")),
    ],
)
def test_parse_params_config_errors_name_the_field_and_the_config(text, needles):
    with pytest.raises(SettingsError) as e:
        parse_params_config(text)
    assert all(n in str(e.value) for n in needles), str(e.value)


# ---- run-time parameters -------------------------------------------------------------------------------


def test_resolve_flow_settings_applies_parameters_without_touching_the_config():
    config = parse_params_config(TINY.read_text())
    out = resolve_flow_settings(config, max_steps=7, eval_limit=3)  # validated once: a Settings
    assert out.train.max_steps == 7 and out.eval.limit == 3
    assert config["train"]["max_steps"] == 600 and config["eval"]["limit"] != 3  # the input is not mutated
    same = resolve_flow_settings(config)  # 0 = keep the recipe's values
    assert same.to_dict() == config


def test_resolve_flow_settings_revalidates():
    config = parse_params_config(TINY.read_text())
    config["train"]["global_batch_size"] = 6  # not a multiple of local_batch_size 8
    with pytest.raises(Exception, match="global_batch_size"):
        resolve_flow_settings(config)


# ---- run dir -----------------------------------------------------------------------------------------


def test_flow_run_dir_is_one_dir_per_flow_run_under_the_run_dir_or_runs_name():
    s = load_settings(TINY)
    assert flow_run_dir(s, "17") == str(Path("runs") / "tiny_mdlm" / "flow-17")
    assert flow_run_dir(s.to_dict(), "17") == flow_run_dir(s, "17")  # the artifact dict works too
    custom = load_settings(TINY, run_dir="/data/runs/x")
    assert flow_run_dir(custom, "abc") == "/data/runs/x/flow-abc"
    assert flow_run_dir(custom, "abc") != flow_run_dir(custom, "abd")


# ---- evaluate: which samplers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("mdlm", ["llada", "llada2"]),
        ("scdd", ["scdd", "llada"]),
        ("hybrid", ["nemotron", "llada"]),
        ("block_diffusion", ["gemma"]),
        ("idlm", ["idlm"]),
        ("dflash", ["acceptance"]),
    ],
)
def test_eval_samplers_per_mode_default_first(mode, want):
    assert eval_samplers(load_settings(ROOT / "params" / f"tiny_{mode}.yaml")) == want


def test_eval_samplers_explicit_list_and_unknown_names():
    s = load_settings(TINY, eval={"samplers": ["llada"]})
    assert eval_samplers(s) == ["llada"]
    d = load_settings(ROOT / "params" / "tiny_dflash.yaml", eval={"samplers": ["acceptance"]})
    assert eval_samplers(d) == ["acceptance"]
    with pytest.raises(UserError, match=r"eval.samplers: unknown sampler\(s\) \['nope'\]"):
        eval_samplers(load_settings(TINY, eval={"samplers": ["llada", "nope"]}))
    with pytest.raises(UserError, match="acceptance"):  # acceptance is a DFlash evaluation only
        eval_samplers(load_settings(TINY, eval={"samplers": ["acceptance"]}))


# ---- end: the results table and the next commands --------------------------------------------------------


def test_next_steps_message_shows_untrained_vs_trained_the_decision_and_commands():
    from dllmflow.workflow.finetune import next_steps_message

    evals = {
        "llada": {
            "metrics": {"exact_match_flexible": 0.97, "tokens_per_s": 4100.0, "nfe": 8.0, "num_examples": 64},
            "baseline": {"metrics": {"exact_match_flexible": 0.0}},
            "predictions": [{"prompt": "What is 47 + 38?"}],
        }
    }
    registration = {
        "tracking_uri": "sqlite:///m.db", "model_name": "m", "version": 2, "sampler": "llada",
        "gate_promoted": False, "gate_reason": "exact_match_flexible 0.0100 below the floor 0.05",
    }  # fmt: skip
    text = next_steps_message(load_settings(), registration, "F/1/end/3", evals=evals, run_dir="runs/x")
    row = next(line for line in text.splitlines() if "llada" in line and "64" in line)
    assert [c.strip() for c in row.split("│")[1:6]] == ["llada", "64", "0.000", "0.970", "4,100"]
    assert "8.0" in row and "\x1b[" not in text  # no colour codes: a CI log reads it too
    assert "m v2 kept as @candidate (not champion)" in text and "below the floor 0.05" in text
    assert "dllmflow generate --checkpoint runs/x --prompt 'What is 47 + 38?'" in text
    assert "card get end --id report card.html" in text and "models:/m@champion" in text


# ---- eval.cache and eval.sweep ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needles"),
    [  # idlm decodes with its exact cache only (cache: none turns it off): no Fast-dLLM cache mode
        ("dllm: {mode: idlm, mask_token_id: 2}\neval: {cache: dual}\n", ("eval.cache", "'dual'", "idlm")),
        ("dllm: {mode: idlm, mask_token_id: 2}\neval: {sweep: {cache: [none, prefix]}}\n",
         ("eval.sweep.cache", "'prefix'", "idlm takes cache: none")),
        ("dllm: {mode: hybrid}\neval: {samplers: [nemotron], cache: prefix}\n",
         ("eval.cache", "nemotron takes cache: none")),
    ],
)  # fmt: skip
def test_a_cache_no_evaluated_sampler_can_use_is_refused_at_parse_time(text, needles):
    with pytest.raises(SettingsError) as e:
        parse_params_config(text)
    assert all(n in str(e.value) for n in needles), str(e.value)
    # and before training (the train step's check; the start step's parameters cannot change it)
    settings = resolve_flow_settings(load_settings(TINY).to_dict() | yaml.safe_load(text))
    with pytest.raises(SettingsError, match="eval.cache|eval.sweep.cache"):
        eval_samplers(settings)


def test_eval_cache_applies_to_the_samplers_that_take_it(monkeypatch):
    from _cache_config import with_llada_cache

    from dllmflow.diffusion.samplers.eval_knobs import eval_defaults

    with_llada_cache(monkeypatch)
    # hybrid: nemotron (its own exact cache) and llada (Fast-dLLM): dual is for llada, nemotron runs as is
    s = resolve_flow_settings(parse_params_config("dllm: {mode: hybrid}\neval: {cache: dual}\n"))
    assert eval_samplers(s) == ["nemotron", "llada"]
    assert eval_defaults(s.eval, "llada")["cache"] == "dual" and "cache" not in eval_defaults(
        s.eval, "nemotron"
    )


def test_a_sweep_key_no_evaluated_sampler_takes_is_refused_before_training():
    # gemma decodes block_diffusion (the recipe's mode): with no threshold option, a threshold sweep is refused
    s = load_settings(TINY.with_name("tiny_block_diffusion.yaml"),
                      eval={"samplers": ["gemma"], "cache": None, "sweep": {"threshold": [None, 0.9]}})  # fmt: skip
    with pytest.raises(
        SettingsError, match=r"eval.sweep.threshold: 0.9 .* \(gemma\): none of them has a threshold"
    ):
        eval_samplers(s)
    assert eval_samplers(load_settings(TINY, eval={"sweep": {"threshold": [None, 0.9]}})) == [
        "llada",
        "llada2",
    ]


@pytest.mark.parametrize("recipe", ["tiny_addition", "tiny_mdlm"])  # tiny_mdlm: eval.cache dual and a sweep
def test_the_recipe_parse_and_the_registered_signature_stay_torch_free(recipe):
    """The sampler configs are checked without the samplers: the flow's parse (every `--help`, `show`,
    Argo compile) and `register`'s model signature do not pay torch's import."""
    import subprocess
    import sys

    code = ("import sys; from dllmflow.workflow.finetune import parse_params_config; "
            f"parse_params_config(open('params/{recipe}.yaml').read()); "
            "from dllmflow.tracking.pyfunc_runtime import build_signature; "
            "build_signature('llada', {'threshold': 0.9, 'cache': 'dual'}); "
            "assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_evaluate_sampler_with_a_sweep_keeps_the_chosen_point_and_the_table_names_it(tmp_path):
    from _tiny_eval import tiny_eval_export

    from dllmflow.evaluation.sweep import choose_setting
    from dllmflow.workflow.finetune import evaluate_sampler, results_table

    ckpt, settings = tiny_eval_export(tmp_path)
    run_dir = tmp_path / "run"  # the flow's run layout: checkpoints/LATEST -> step dir -> model/consolidated
    (run_dir / "checkpoints" / "step_000004" / "model").mkdir(parents=True)
    ckpt.rename(run_dir / "checkpoints" / "step_000004" / "model" / "consolidated")
    (run_dir / "checkpoints" / "LATEST").symlink_to("step_000004")
    s = Settings.coerce(
        settings.to_dict() | {"eval": {**settings.eval.model_dump(), "sweep": {"steps": [2, 4]}}}
    )
    result = evaluate_sampler(s, str(run_dir), "llada")
    sweep = result["sweep"]
    assert [p["setting"] for p in sweep["points"]] == [{"steps": 2}, {"steps": 4}]
    assert sweep["chosen"] == choose_setting(sweep["points"], s.eval.sweep_tolerance)
    chosen = sweep["points"][sweep["chosen"]]
    assert (
        result["protocol"]["sampler_settings"]["steps"] == chosen["setting"]["steps"]
    )  # what register records
    row = next(line for line in results_table({"llada": result}).splitlines() if "llada" in line)
    assert f"steps={chosen['setting']['steps']}" in row
