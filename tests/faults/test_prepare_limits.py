"""`dllmflow prepare` bounds what one row may cost: a JSONL line over `dataset.max_row_bytes` is dropped
as malformed before it is parsed or tokenised (read with a bounded read, never held whole), and a row
nested deeper than the JSON depth limit is malformed, not a RecursionError. Both are named in the
manifest; the other rows are prepared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllmflow.data.chat import load_chat_rows
from dllmflow.data.formats import MAX_JSON_DEPTH, check_messages
from dllmflow.data.prepare import prepare
from dllmflow.settings import load_settings

QA = [(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}.\n#### {2 * i}") for i in range(8)]
MB = 1 << 20


def _lines() -> list[bytes]:
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QA]
    return [(json.dumps({"messages": c}) + "\n").encode() for c in chats]


def _settings(tmp_path: Path, source: Path, **dataset):
    return load_settings(
        tokenizer={"train_vocab_size": 300},
        dataset={"path_or_dataset_id": str(source), "prepared_dir": str(tmp_path / "prepared"),
                 "seq_length": 128, "eval_fraction": 0.0, **dataset},
    )  # fmt: skip


def test_a_50_mb_line_is_dropped_before_parsing(tmp_path):
    src = tmp_path / "chat.jsonl"
    huge = json.dumps({"text": "x" * (50 * MB)}).encode() + b"\n"
    lines = _lines()
    src.write_bytes(b"".join(lines[:3]) + huge + b"".join(lines[3:]))
    del huge
    m = prepare(_settings(tmp_path, src))
    assert m["dropped"]["malformed"] == 1 and m["splits"]["train"]["rows"] == len(QA)
    (reason,) = m["dropped_reasons"]
    assert "dataset.max_row_bytes" in reason
    assert m["dropped_examples"] == [f"{src}:line 4: {reason}"]
    # the limit is a setting: raised above the line, the row is read (and kept as a text row)
    loaded = load_chat_rows(str(src), max_row_bytes=64 * MB)
    assert len(loaded.rows) == len(QA) + 1 and not loaded.dropped


def test_line_limit_is_exact_and_line_numbers_stay_right(tmp_path):
    src = tmp_path / "chat.jsonl"
    lines = _lines()
    src.write_bytes(lines[0] + b'{"text": "' + b"y" * 5000 + b'"}\n' + lines[1])
    loaded = load_chat_rows(str(src), max_row_bytes=len(lines[0]))
    assert len(loaded.rows) == 2 and sum(loaded.dropped.values()) == 1
    assert loaded.examples[0].startswith(f"{src}:line 2: malformed")
    assert load_chat_rows(str(src), max_row_bytes=len(lines[0]) - 1).rows == []  # the newline counts


@pytest.mark.parametrize("depth", [100_000, MAX_JSON_DEPTH + 1])
def test_deeply_nested_row_is_malformed_not_a_recursion_error(tmp_path, depth):
    src = tmp_path / "chat.jsonl"
    nested = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}\n"
    as_text = b'{"messages": "' + b"[" * depth + b"]" * depth + b'"}\n'  # a JSON string holding it
    src.write_bytes(nested + b"".join(_lines()) + as_text)
    m = prepare(_settings(tmp_path, src))
    assert m["dropped"]["malformed"] == 2 and m["splits"]["train"]["rows"] == len(QA)
    assert all("nested deeper than" in r for r in m["dropped_reasons"])
    assert [e.split(": ", 1)[0] for e in m["dropped_examples"]] == [f"{src}:line 1", f"{src}:line 10"]


def test_nesting_within_the_limit_still_parses():
    ok = [[]]
    for _ in range(MAX_JSON_DEPTH - 2):
        ok = [ok]
    assert check_messages(json.dumps(ok))[1] == "malformed: a message is not a {role, content} mapping"
    chat = [{"role": "user", "content": "[[[[" * 100}, {"role": "assistant", "content": "]]" * 500}]
    assert check_messages(json.dumps(chat)) == (chat, None)  # brackets inside strings are not nesting


ABSURD = {
    "dataset.seq_length": ({"dataset": {"seq_length": 10**7}}, "less than or equal to 1048576"),
    "train.local_batch_size": ({"train": {"local_batch_size": 10**6, "global_batch_size": 10**6}}, "65536"),
    "train.global_batch_size": ({"train": {"global_batch_size": 10**6}}, "65536"),
    "eval.max_new_tokens": ({"eval": {"max_new_tokens": 10**7}}, "1048576"),
    "eval.batch_size": ({"eval": {"batch_size": 10**6}}, "65536"),
    "model.tiny.hidden_size": (
        {"model": {"tiny": {"hidden_size": 10**6, "num_attention_heads": 1}}},
        "65536",
    ),
    "model.tiny.max_position_embeddings": (
        {"model": {"tiny": {"max_position_embeddings": 10**8}}},
        "1048576",
    ),
    "regenerate.max_new_tokens": ({"regenerate": {"max_new_tokens": 10**7}}, "1048576"),
    "train.local_batch_size x dataset.seq_length": (
        {"dataset": {"seq_length": 1 << 20}, "train": {"local_batch_size": 32, "global_batch_size": 32}},
        r"33554432 tokens in one forward, above 16777216",
    ),
}


@pytest.mark.parametrize("field", list(ABSURD))
def test_absurd_sizes_are_refused_at_parse_naming_the_field(field):
    """A size no run means (10^7-token sequences, 10^6-row batches tried to allocate) is refused when
    the settings are read, naming the field, before anything is built."""
    from dllmflow.settings import SettingsError

    overrides, why = ABSURD[field]
    with pytest.raises(SettingsError, match=rf"{field.split(' ')[0]}.*{why}"):
        load_settings(**overrides)


def test_large_but_sane_sizes_still_parse():
    s = load_settings(
        dataset={"seq_length": 1 << 20}, train={"local_batch_size": 16, "global_batch_size": 1 << 16}
    )
    assert s.dataset.seq_length == 1 << 20 and s.train.global_batch_size == 1 << 16
