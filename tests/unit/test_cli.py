"""The `dllmflow` command's conventions: kebab-case flags in --help (snake_case aliases parse but stay
hidden), no test-only flag shown, --version, `config show` with origins, and `export` (dry run, staging
copy, the Hub push failing clearly offline)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re

import pytest

from dllmflow.cli import COMMANDS, build_parser, main
from dllmflow.common.cli_args import HIDDEN_ALIASES
from dllmflow.settings import load_settings

TEST_ONLY_FLAGS = ("--fail-first", "--fail-status", "--delay-s", "--turn-delay-s")
SNAKE_FLAG = re.compile(r"--[a-z0-9]+_[a-z0-9_]+")


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def subparser(name: str):
    parser, _ = build_parser([name])
    return parser._subparsers._group_actions[0].choices[name]


# ---- conventions --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[name] for name in COMMANDS] + [["config", "show"], []])
def test_help_shows_kebab_case_and_no_test_only_flag(capsys, argv):
    text = help_text(capsys, *argv)
    assert not SNAKE_FLAG.findall(text), SNAKE_FLAG.findall(text)
    assert not [f for f in TEST_ONLY_FLAGS if f in text]


FLAG_ALIASES = {"--no-kv-cache": "cache"}  # the guide's spelling of --cache none


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_snake_alias_is_the_same_option(name):
    actions = subparser(name)._option_string_actions
    for action in set(actions.values()):
        for alias in getattr(action, HIDDEN_ALIASES, ()):
            kebab = alias.replace("_", "-")
            own = FLAG_ALIASES.get(kebab, kebab[2:].replace("-", "_"))  # an alias flag writes its flag's
            assert actions[alias] is actions[kebab] and action.dest == own
    snake = [s for s in actions if SNAKE_FLAG.fullmatch(s)]
    hidden = {a for act in actions.values() for a in getattr(act, HIDDEN_ALIASES, ())}
    assert set(snake) == hidden  # no snake_case flag is anything but an alias


def test_guide_spellings_parse():
    argv = ["generate", "--checkpoint", "c", "--prompt", "p", "--max_new_tokens", "64", "--mask_id", "7",
            "--no_kv_cache", "--uniform_ratio", "0.1", "--block_size", "8"]  # fmt: skip
    parser, _ = build_parser(argv)
    args = parser.parse_args(argv)
    assert (args.max_new_tokens, args.mask_id, args.cache, args.uniform_ratio, args.block_size) == (
        64, 7, "none", 0.1, 8
    )  # fmt: skip
    kebab = ["generate", "--checkpoint", "c", "--prompt", "p", "--max-new-tokens", "64", "--no-kv-cache"]
    args = build_parser(kebab)[0].parse_args(kebab)
    assert args.max_new_tokens == 64 and args.cache == "none" and args.sampler is None
    argv = ["evaluate", "--checkpoint", "c", "--prepared_dir", "d"]
    assert build_parser(argv)[0].parse_args(argv).prepared_dir == "d"
    argv = ["serve", "--model_path", "m", "--max_batch_size", "3", "--max_body_bytes", "1"]
    args = build_parser(argv)[0].parse_args(argv)
    assert (args.model_path, args.max_batch_size, args.max_body_bytes) == ("m", 3, 1)
    argv = ["regenerate", "--output_dir", "o", "--max_new_tokens", "9"]
    args = build_parser(argv)[0].parse_args(argv)
    assert (args.output_dir, args.max_new_tokens) == ("o", 9)
    argv = ["train", "--params", "x.yaml", "--run_dir", "r"]
    assert build_parser(argv)[0].parse_args(argv).run_dir == "r"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"dllmflow {importlib.metadata.version('dllmflow')}"


# ---- config show --------------------------------------------------------------------------------


def test_config_show_values_and_origins(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: shown\ntrain:\n  lr: 0.0003\n")
    monkeypatch.setenv("DLLMFLOW_TRAIN__MAX_STEPS", "7")
    assert main(["config", "show", "--params", str(recipe), "--set", "eval.limit=4"]) == 0
    lines = capsys.readouterr().out.splitlines()

    by_key, stack = {}, []  # dotted key -> its line, from the indentation
    for text in lines:
        depth = (len(text) - len(text.lstrip())) // 2
        stack[depth:] = [text.strip().split(":")[0]]
        by_key[".".join(stack)] = text

    assert by_key["name"].startswith("name: shown ") and by_key["name"].endswith(f"# {recipe}")
    assert by_key["train.lr"].split("#")[0].strip() == "lr: 0.0003" and by_key["train.lr"].endswith(
        f"# {recipe}"
    )
    assert "max_steps: 7 " in by_key["train.max_steps"]
    assert by_key["train.max_steps"].endswith("# env DLLMFLOW_TRAIN__MAX_STEPS")
    assert "limit: 4 " in by_key["eval.limit"] and by_key["eval.limit"].endswith("# override")
    assert by_key["train.global_batch_size"].endswith("# default")

    import yaml

    shown = yaml.safe_load("\n".join(lines))  # the comments aside, a complete recipe
    assert shown == load_settings(recipe, **{"eval.limit": 4}).to_dict()

    assert main(["config", "show", "--params", str(recipe), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["train"]["lr"] == 0.0003 and out["origins"]["train.lr"] == str(recipe)
    assert out["origins"]["train.max_steps"] == "env DLLMFLOW_TRAIN__MAX_STEPS"
    assert out["origins"]["train.seed"] == "default"


def test_config_show_bad_setting_is_one_line(tmp_path, capsys):
    assert main(["config", "show", "--set", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err


# ---- export -------------------------------------------------------------------------------------


@pytest.fixture
def export_dir(tmp_path):
    """An export without a card (from before cards): configs, fake weights, settings.json."""
    out = tmp_path / "run" / "checkpoints" / "step_000002" / "model" / "consolidated"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 300}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (out / "model.safetensors").write_bytes(b"\0" * 1000)
    load_settings(name="exported").write_json(out / "settings.json")
    (tmp_path / "run" / "checkpoints" / "LATEST").symlink_to("step_000002")
    return out


def test_export_dry_run_lists_files_and_card(export_dir, capsys):
    before = {p.name: p.read_bytes() for p in export_dir.iterdir()}
    run = export_dir.parents[3]
    assert main(["export", "--checkpoint", str(run), "--push-to-hub", "me/tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    sha = hashlib.sha256(before["model.safetensors"]).hexdigest()
    assert f"1,000  {sha}  model.safetensors" in out
    assert re.search(r"[0-9a-f]{64}  README\.md", out) and "5 files" in out
    assert "---- README.md (model card) ----\n---\nlibrary_name: transformers" in out
    assert "dry run: nothing pushed to me/tiny" in out
    assert {p.name: p.read_bytes() for p in export_dir.iterdir()} == before  # the export is untouched


def test_export_output_is_the_staging_copy(export_dir, tmp_path, capsys):
    staged = tmp_path / "staged"
    assert main(["export", "--checkpoint", str(export_dir), "--output", str(staged), "--dry-run"]) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in staged.iterdir())
    assert names == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "settings.json",
    ]
    for name in names:
        assert hashlib.sha256((staged / name).read_bytes()).hexdigest() in out
    assert json.loads((staged / "config.json").read_text())["dllm"]["default_sampler"] == "llada"
    assert "dllm" not in json.loads(
        (export_dir / "config.json").read_text()
    )  # the copy has it, not the source
    # a second run replaces its own staging copy (proved ours by the `dllm` block) whole; nothing
    # half-written or old is left next to it (tests/faults/test_output_paths.py: what is not ours is refused)
    (staged / "stale.txt").write_text("left by an older export")
    assert main(["export", "--checkpoint", str(export_dir), "--output", str(staged)]) == 0
    assert sorted(p.name for p in staged.iterdir()) == names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "staged"]


def test_export_failure_leaves_nothing(tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert main(["export", "--checkpoint", str(bare), "--output", str(tmp_path / "out")]) == 2
    assert "not a dllmflow export" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare"]


def test_push_to_hub_errors_are_clear(export_dir, capsys):
    assert main(["export", "--checkpoint", str(export_dir), "--push-to-hub", "--dry-run"]) == 2
    assert "--push-to-hub needs a repo id" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(export_dir), "--push-to-hub", "not a/repo/id"]) == 2
    assert "repo id" in capsys.readouterr().err
    # the real push, offline (HF_HUB_OFFLINE=1 in tests): one line naming the cause, no traceback
    assert main(["export", "--checkpoint", str(export_dir), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllmflow export: error: push to me/tiny failed") and "Traceback" not in err
