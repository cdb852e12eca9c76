"""Output paths the project writes as a unit (`dataset.prepared_dir`, `dllmflow export --output`) are
replaced only when they hold this project's artefact of the same kind (proved by its manifest/marker):
an existing file, an unrelated directory or another kind of artefact is refused with one line naming
the path and left untouched; our own artefact is still replaced atomically, under the dir's lock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllmflow.cli import main as cli_main
from dllmflow.common.outputs import LOCK_FILE, DirLockedError, OutputPathError, hold_dir_lock
from dllmflow.data.prepare import prepare
from dllmflow.settings import load_settings

QA = [(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}.\n#### {2 * i}") for i in range(8)]


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "chat.jsonl"
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QA]
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return src


def _settings(tmp_path: Path, out: Path, **dataset):
    return load_settings(
        tokenizer={"train_vocab_size": 300},
        dataset={"path_or_dataset_id": str(_source(tmp_path)), "prepared_dir": str(out), "seq_length": 128,
                 "eval_fraction": 0.0, **dataset},
    )  # fmt: skip


def _params(tmp_path: Path, out: Path) -> Path:
    p = tmp_path / "p.yaml"
    p.write_text(
        f"dataset: {{path_or_dataset_id: {_source(tmp_path)}, prepared_dir: {out}, seq_length: 128, "
        "eval_fraction: 0.0}\ntokenizer: {train_vocab_size: 300}\n"
    )
    return p


def test_prepare_refuses_an_unrelated_directory_and_keeps_its_files(tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"\xff\xd8 mine")
    with pytest.raises(OutputPathError, match=rf"dataset.prepared_dir = {out} .*no manifest.json"):
        prepare(_settings(tmp_path, out))
    assert cli_main(["prepare", "--params", str(_params(tmp_path, out))]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["holiday.jpg"]  # no lock file left in a dir not ours
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".photos")]  # no temp left beside it


def test_prepare_refuses_an_existing_file(tmp_path):
    out = tmp_path / "hosts"
    out.write_text("127.0.0.1 localhost\n")
    with pytest.raises(OutputPathError, match=rf"{out} is an existing file"):
        prepare(_settings(tmp_path, out))
    assert out.read_text() == "127.0.0.1 localhost\n"


def test_prepare_refuses_another_kind_of_manifest(tmp_path):
    """A dir with a manifest.json that is not a prepared dataset's (a web app's, a regeneration
    output's) is not ours to replace."""
    out = tmp_path / "webapp"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "my app", "icons": []}')
    (out / "index.html").write_text("<html/>")
    with pytest.raises(OutputPathError, match=rf"{out}.*not a prepared dataset"):
        prepare(_settings(tmp_path, out))
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "manifest.json"]


def test_prepare_replaces_its_own_output_atomically(tmp_path):
    out = tmp_path / "prepared"
    first = prepare(_settings(tmp_path, out))
    second = prepare(_settings(tmp_path, out, seq_length=96))  # another fingerprint: rebuilt in place
    assert second["fingerprint"] != first["fingerprint"]
    assert json.loads((out / "manifest.json").read_text())["seq_length"] == 96
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prepared")]  # no temp/old left


def test_prepare_is_one_writer_per_prepared_dir(tmp_path):
    out = tmp_path / "prepared"
    with hold_dir_lock(out, "prepare"):  # another prepare of the same dir is running
        with pytest.raises(DirLockedError, match=rf"{out} is in use by pid \d+ \(prepare\)"):
            prepare(_settings(tmp_path, out))
    prepare(_settings(tmp_path, out))
    assert (out / "manifest.json").is_file()
    # the lock held through the swap is the dir's lock file (hard-linked into the new dir)
    assert (out / LOCK_FILE).exists()


# ---- dllmflow export --output --------------------------------------------------------------------


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    from dllmflow.data.tokenizer import train_bpe_tokenizer
    from dllmflow.diffusion.strategies.base import export_facts
    from dllmflow.models.build import build_tiny_model
    from dllmflow.models.model_card import write_export_card
    from dllmflow.settings.sections import TinyModelConfig

    out = tmp_path_factory.mktemp("export") / "consolidated"
    tok = train_bpe_tokenizer(["What is 2 + 3? The answer is 5. #### 5"] * 5, 300, "<mask>", "<pad>", "<eos>")
    model = build_tiny_model(TinyModelConfig(), tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    settings = load_settings()
    settings.write_json(out / "settings.json")
    write_export_card(out, export_facts(settings, tok.mask_token_id), generation_config=False)
    return out


@pytest.mark.parametrize("kind", ["file", "unrelated dir"])
def test_export_output_refuses_what_is_not_an_export(export_dir, tmp_path, capsys, kind):
    dest = tmp_path / "dest"
    if kind == "file":
        dest.write_text("keep me")
    else:
        dest.mkdir()
        (dest / "config.json").write_text('{"not": "ours"}')  # even a config.json: no dllm block
    assert cli_main(["export", "--checkpoint", str(export_dir), "--output", str(dest)]) == 2
    err = capsys.readouterr().err
    assert f"--output = {dest}" in err and "Traceback" not in err
    if kind == "file":
        assert dest.read_text() == "keep me"
    else:
        assert [p.name for p in dest.iterdir()] == ["config.json"]


def test_export_output_replaces_its_own_staging_copy(export_dir, tmp_path, capsys):
    dest = tmp_path / "dest"
    assert cli_main(["export", "--checkpoint", str(export_dir), "--output", str(dest)]) == 0
    (dest / "stale.txt").write_text("from an older export")
    assert cli_main(["export", "--checkpoint", str(export_dir), "--output", str(dest)]) == 0
    assert not (dest / "stale.txt").exists() and (dest / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name != "dest"]  # no temp or old copy left


# ---- other model dirs the project writes once: the tiny DFlash target, the offline SmolLM2 export ----


@pytest.mark.parametrize("kind", ["file", "unrelated dir"])
def test_tiny_target_dir_refuses_what_is_not_a_model(tmp_path, kind):
    from dllmflow.data.tokenizer import train_bpe_tokenizer
    from dllmflow.models.dflash_target import build_tiny_target

    out = tmp_path / "target"
    if kind == "file":
        out.write_text("keep me")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    tok = train_bpe_tokenizer(["What is 2 + 3? The answer is 5."] * 5, 300, "<mask>", "<pad>", "<eos>")
    with pytest.raises(OutputPathError, match=rf"{out}.*not a tiny DFlash target"):
        build_tiny_target(out, tok)
    assert (out if kind == "file" else out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no temp left beside it


def test_offline_export_refuses_a_dir_not_ours_before_reading_weights(tmp_path):
    from dllmflow.models.offline import export_smollm2

    out = tmp_path / "smollm2"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(OutputPathError, match=rf"{out}.*not a model export"):
        export_smollm2(out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("kind", ["foreign file", "symlink", "directory"])
def test_evaluate_output_refuses_what_is_not_an_evaluation(tmp_path, capsys, kind):
    """`evaluate --output` onto a file it did not write (was: overwritten), a symlink (was: the link
    replaced) or a directory (was: a traceback after the whole evaluation): refused before the model
    loads, in one line naming the path, the bytes untouched."""
    target = tmp_path / "mine.json"
    target.write_text('{"my": "notes"}\n')
    out = {"foreign file": target, "symlink": tmp_path / "link.json", "directory": tmp_path / "dir"}[kind]
    if kind == "symlink":
        out.symlink_to(target)
    if kind == "directory":
        out.mkdir()
        (out / "keep.txt").write_text("keep")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code = cli_main(["evaluate", "--checkpoint", str(tmp_path / "no-such-run"), "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and f"--output {out}" in err and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before and out.is_symlink() == (
        kind == "symlink"
    )


def test_an_evaluation_result_is_ours_to_replace(tmp_path):
    from dllmflow.common.outputs import check_output_file

    result = tmp_path / "eval.json"
    assert check_output_file(result, kind="evaluation result", keys=("metrics", "protocol")) is False
    result.write_text(json.dumps({"metrics": {}, "protocol": {}, "predictions": []}))
    assert check_output_file(result, kind="evaluation result", keys=("metrics", "protocol")) is True
