"""Bring-your-own-data formats (docs/data_formats.md): each format prepares, field mapping, weighted
mixtures, the synthetic `embedded:addition` task, and the errors (unknown format, a mapping to a missing
field, weights that do not sum to a positive number, an empty held-out split) that leave nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dllmflow.data.chat import load_chat_rows
from dllmflow.data.dataset import PreparedDataset
from dllmflow.data.formats import RowSpec
from dllmflow.data.mixture import mix_rows
from dllmflow.data.prepare import prepare
from dllmflow.data.synthetic import addition_rows
from dllmflow.data.task import gold_answer
from dllmflow.data.tokenizer import load_tokenizer
from dllmflow.errors import UserError
from dllmflow.settings import load_settings

QA = [
    (f"What is {a} plus {b}?", f"#### {a + b}")
    for a, b in [(1, 2), (30, 4), (5, 66), (7, 8), (12, 9), (3, 3)]
]


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def settings_for(tmp_path: Path, **dataset):
    ds = {"prepared_dir": str(tmp_path / "prepared"), "seq_length": 96, "eval_fraction": 0.0, **dataset}
    return load_settings(tokenizer={"train_vocab_size": 300}, dataset=ds)


def train_messages(s) -> list[list[dict]]:
    return [r["messages"] for r in PreparedDataset(s.dataset.prepared_dir, "train").rows()]


# ---- one test per format ------------------------------------------------------------------------


def test_messages_format(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA
    ]
    s = settings_for(
        tmp_path, path_or_dataset_id=str(write_jsonl(tmp_path / "chat.jsonl", rows)), format="messages"
    )
    assert prepare(s)["splits"]["train"]["rows"] == len(QA)
    assert train_messages(s) == [r["messages"] for r in rows]


def test_prompt_completion_format_auto_detected_and_mapped(tmp_path):
    plain = write_jsonl(
        tmp_path / "pc.jsonl", [{"prompt": q, "completion": a, "system": "Add."} for q, a in QA]
    )
    s = settings_for(tmp_path / "a", path_or_dataset_id=str(plain))  # format auto
    prepare(s)
    assert train_messages(s)[0] == [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": QA[0][0]},
        {"role": "assistant", "content": QA[0][1]},
    ]
    mapped = write_jsonl(tmp_path / "gsm.jsonl", [{"question": q, "answer": a} for q, a in QA])
    s2 = settings_for(tmp_path / "b", path_or_dataset_id=str(mapped), format="prompt_completion",
                      fields={"prompt": "question", "completion": "answer"})  # fmt: skip
    prepare(s2)
    assert [m[-1]["content"] for m in train_messages(s2)] == [a for _, a in QA]


def test_alpaca_format_appends_input(tmp_path):
    recs = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "#### 5"},
            {"instruction": "What is 4 + 4?", "input": "", "output": "#### 8"}]  # fmt: skip
    pdir = tmp_path / "alpaca"
    pdir.mkdir()
    pq.write_table(pa.Table.from_pylist(recs), pdir / "part.parquet")  # parquet input
    s = settings_for(tmp_path, path_or_dataset_id=str(pdir), format="alpaca")
    prepare(s)
    got = train_messages(s)
    assert got[0][0] == {"role": "user", "content": "Add the numbers.\n\n2 and 3"}
    assert got[1][0] == {"role": "user", "content": "What is 4 + 4?"} and got[1][1]["content"] == "#### 8"


def test_text_format_supervises_every_token(tmp_path):
    texts = ["The cat sat on the mat.", "Diffusion models denoise masked tokens.", "1 + 1 = 2"]
    src = write_jsonl(tmp_path / "corpus.jsonl", [{"body": t} for t in texts])
    s = settings_for(tmp_path, path_or_dataset_id=str(src), format="text", fields={"text": "body"})
    prepare(s)
    ds, tok = PreparedDataset(s.dataset.prepared_dir, "train"), load_tokenizer(s.dataset.prepared_dir)
    for i, text in enumerate(texts):
        item = ds[i]
        assert all(item["loss_mask"]) and item["prompt_length"] == 0
        assert item["input_ids"][-1] == tok.eos_token_id
        assert tok.decode(item["input_ids"][:-1]) == text
    assert ds.rows()[0]["answer"] == texts[0]


# ---- malformed rows and bad settings ------------------------------------------------------------


def test_malformed_row_names_file_line_and_field(tmp_path):
    recs = [{"question": q, "answer": a} for q, a in QA[:3]]
    recs.insert(1, {"question": "No answer here"})
    recs.insert(2, {"question": 5, "answer": "#### 5"})
    src = write_jsonl(tmp_path / "qa.jsonl", recs)
    s = settings_for(
        tmp_path, path_or_dataset_id=str(src), fields={"prompt": "question", "completion": "answer"}
    )
    m = prepare(s)  # auto: the mapping makes these prompt/completion rows
    assert m["splits"]["train"]["rows"] == 3
    assert m["dropped_examples"] == [
        f"{src}:line 2: malformed: no messages, prompt/completion, instruction/output or text field",
        f"{src}:line 3: malformed: field 'question' is int, not a string",
    ]
    s2 = settings_for(tmp_path / "x", path_or_dataset_id=str(src), format="prompt_completion",
                      fields={"prompt": "question", "completion": "answer"})  # fmt: skip
    m2 = prepare(s2)
    assert m2["dropped_examples"][0] == f"{src}:line 2: malformed: missing field 'answer'"
    assert m2["dropped_reasons"] == {
        "malformed: field 'question' is int, not a string": 1,
        "malformed: missing field 'answer'": 1,
    }


def assert_nothing_written(s):
    out = Path(s.dataset.prepared_dir)
    assert not out.exists() and not any(p.name.startswith(f".{out.name}") for p in out.parent.iterdir())


def test_unknown_format_and_unknown_field_key(tmp_path):
    with pytest.raises(UserError, match="dataset.format"):
        settings_for(tmp_path, format="csv")
    with pytest.raises(UserError, match="unknown data format"):
        RowSpec.build("csv")
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": q, "completion": a} for q, a in QA])
    s = settings_for(
        tmp_path, path_or_dataset_id=str(src), format="prompt_completion", fields={"question": "q"}
    )
    with pytest.raises(
        UserError, match=r"dataset.fields.question: not a field of format 'prompt_completion'"
    ):
        prepare(s)
    assert_nothing_written(s)


def test_mapping_to_a_missing_field_is_an_error_naming_it(tmp_path):
    src = write_jsonl(tmp_path / "gsm.jsonl", [{"question": q, "answer": a} for q, a in QA])
    s = settings_for(tmp_path, path_or_dataset_id=str(src), format="prompt_completion",
                     fields={"prompt": "question", "completion": "solution"})  # fmt: skip
    with pytest.raises(UserError, match=r"gsm\.jsonl: no column 'solution' \(dataset.fields.completion\)"):
        prepare(s)
    assert_nothing_written(s)


def test_weights_must_sum_to_a_positive_number(tmp_path):
    for mixture in ([{"path": "a.jsonl", "weight": 0.0}], []):
        with pytest.raises(UserError, match="dataset.mixture"):
            settings_for(tmp_path, mixture=mixture)
    with pytest.raises(UserError, match="dataset.mixture"):
        settings_for(tmp_path, mixture=[{"path": "a.jsonl", "weight": -1}])


def test_empty_held_out_split_is_an_error(tmp_path):
    src = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "What is 1 + 1?", "completion": "#### 2"}])
    s = settings_for(tmp_path, path_or_dataset_id=str(src), eval_fraction=0.01)
    with pytest.raises(UserError, match=r"dataset.eval_fraction=0.01 left no held-out row"):
        prepare(s)
    assert_nothing_written(s)


# ---- mixtures -----------------------------------------------------------------------------------


def test_mixture_counts_are_weighted_and_deterministic():
    a = [{"id": f"a{i}", "text": f"a{i}"} for i in range(100)]
    b = [{"id": f"b{i}", "text": f"b{i}"} for i in range(10)]
    mixed = mix_rows([(a, 0.75), (b, 0.25)], seed=3)  # b (scarcest for its weight) is used whole
    assert (
        sum(r["id"].startswith("0/") for r in mixed) == 30
        and sum(r["id"].startswith("1/") for r in mixed) == 10
    )
    assert mixed == mix_rows([(a, 0.75), (b, 0.25)], seed=3) != mix_rows([(a, 0.75), (b, 0.25)], seed=4)
    up = mix_rows([(a, 1.0), (b, 1.0)], seed=0, num_rows=60)  # b repeats: 3 passes of 10
    assert len(up) == 60 and len({r["id"] for r in up}) == 60 and "1/b0#2" in {r["id"] for r in up}
    assert mix_rows([(a, 1.0), (b, 0.0)], seed=0) == mix_rows([(a, 1.0)], seed=0)


def test_mixture_of_formats_prepares(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl",
                       [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                        for q, a in QA])  # fmt: skip
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": q + " Now!", "answer": a} for q, a in QA])
    mixture = [
        {"path": str(chat), "weight": 2},
        {"path": str(gsm), "weight": 1, "format": "prompt_completion",
         "fields": {"prompt": "question", "completion": "answer"}},
    ]  # fmt: skip
    s = settings_for(tmp_path, mixture=mixture, seed=1)
    m = prepare(s)
    ids = [r["id"] for r in PreparedDataset(s.dataset.prepared_dir, "train").rows()]
    assert m["splits"]["train"]["rows"] == 9 and sum(i.startswith("1/") for i in ids) == 3
    assert m["source"]["path_or_dataset_id"].startswith("mixture(")
    assert prepare(s)["fingerprint"] == m["fingerprint"]  # reused


def test_single_source_fingerprint_unchanged_by_new_keys(tmp_path):
    from dllmflow.data.prepared_dir import settings_used

    s = settings_for(tmp_path, path_or_dataset_id="x.jsonl")
    assert not {"format", "fields", "mixture", "mixture_rows", "seed"} & set(settings_used(s)["dataset"])
    assert settings_used(settings_for(tmp_path, format="text"))["dataset"]["format"] == "text"


# ---- the synthetic addition task ----------------------------------------------------------------


def test_addition_rows_are_a_pure_function_of_their_settings():
    rows = addition_rows(num_rows=200, seed=7, min_digits=2, max_digits=3)
    assert rows == addition_rows(num_rows=200, seed=7, min_digits=2, max_digits=3)
    assert rows != addition_rows(num_rows=200, seed=8, min_digits=2, max_digits=3)
    questions = [r["messages"][0]["content"] for r in rows]
    assert len(set(questions)) == 200
    for r in rows:
        a, b = map(int, r["messages"][0]["content"].removeprefix("What is ").rstrip("?").split(" + "))
        assert 10 <= a <= 999 and 10 <= b <= 999
        assert gold_answer(r["messages"][1]["content"]) == str(a + b)  # evaluation reads `#### N`
    assert {len(r["messages"][1]["content"]) for r in rows} == {len("#### 0405")}  # fixed width


def test_embedded_addition_prepares_with_a_held_out_split(tmp_path):
    src = load_chat_rows("embedded:addition")
    assert src.files == ["embedded:addition"] and src.rows == load_chat_rows("embedded:addition").rows
    s = load_settings(Path(__file__).parents[2] / "params" / "tiny_addition.yaml",
                      dataset={"prepared_dir": str(tmp_path / "prepared")})  # fmt: skip
    m = prepare(s)
    train, held = (PreparedDataset(s.dataset.prepared_dir, n).rows() for n in ("train", "eval"))
    assert len(held) > 0.2 * len(src.rows) and m["dropped"]["truncated"] == 0
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in held}
    tok = load_tokenizer(s.dataset.prepared_dir)
    assert [tok.decode([i]) for i in tok.encode("405", add_special_tokens=False)] == ["4", "0", "5"]
