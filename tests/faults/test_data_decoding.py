"""A non-UTF-8 byte in a JSONL data file is a malformed row (counted and dropped, like a line that is
not JSON), never a traceback; a file with no usable row is a UserError naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllmflow.cli import main as cli_main
from dllmflow.data.chat import NOT_UTF8, load_chat_rows
from dllmflow.data.prepare import prepare
from dllmflow.errors import UserError
from dllmflow.settings import load_settings

QA = [(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}.\n#### {2 * i}") for i in range(8)]


def _line(q: str, a: str) -> bytes:
    chat = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return (json.dumps({"messages": chat}, ensure_ascii=False) + "\n").encode()


def _settings(tmp_path: Path, source: Path):
    return load_settings(
        tokenizer={"train_vocab_size": 300},
        dataset={"path_or_dataset_id": str(source), "prepared_dir": str(tmp_path / "prepared"),
                 "seq_length": 128, "eval_fraction": 0.0},
    )  # fmt: skip


def test_bad_byte_is_one_malformed_row(tmp_path):
    src = tmp_path / "chat.jsonl"
    bad = _line("Price in \u20ac?", "3 \u20ac.\n#### 3").replace("\u20ac".encode(), b"\xff", 1)
    src.write_bytes(b"".join(_line(q, a) for q, a in QA[:4]) + bad + b"".join(_line(q, a) for q, a in QA[4:]))
    loaded = load_chat_rows(str(src))
    assert len(loaded.rows) == len(QA) and loaded.dropped == {NOT_UTF8: 1} and loaded.num_read == len(QA) + 1
    m = prepare(_settings(tmp_path, src))
    assert m["dropped"]["malformed"] == 1 and m["dropped_reasons"] == {NOT_UTF8: 1}
    assert m["splits"]["train"]["rows"] == len(QA)


def test_valid_utf8_still_reads(tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_bytes(_line("Price in \u20ac?", "3 \u20ac.\n#### 3"))
    assert load_chat_rows(str(src)).rows[0]["messages"][0]["content"] == "Price in \u20ac?"


def test_not_utf8_file_is_a_user_error_naming_it(tmp_path, capsys):
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b"".join(_line(q, a + " \xe9").decode().encode("latin-1") for q, a in QA))
    with pytest.raises(UserError, match=r"latin1\.jsonl.*malformed"):
        prepare(_settings(tmp_path, src))
    params = tmp_path / "p.yaml"
    params.write_text(
        f"dataset: {{path_or_dataset_id: {src}, prepared_dir: {tmp_path / 'prepared'}, seq_length: 128}}\n"
        "tokenizer: {train_vocab_size: 300}\n"
    )
    assert cli_main(["prepare", "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "latin1.jsonl" in err and "Traceback" not in err
