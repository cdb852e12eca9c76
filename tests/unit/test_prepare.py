"""`dllmflow prepare`: embedded GSM8K, chat files, supervision masks, drops, errors, reuse, reading back."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dllmflow.cli import main as cli_main
from dllmflow.data.chat import load_chat_rows
from dllmflow.data.dataset import PreparedDataset
from dllmflow.data.gsm8k import GSM8K_SHA256, gsm8k_path, load_gsm8k_rows
from dllmflow.data.prepare import prepare, split_rows
from dllmflow.data.tokenizer import encode_chat, load_tokenizer
from dllmflow.errors import UserError
from dllmflow.settings import load_settings

QA = [
    ("What is 2+3?", "2+3 = 5.\n#### 5"),
    ("Tom has 4 apples and eats 1. How many are left?", "4-1 = 3 apples.\n#### 3"),
    ("A box holds 12 eggs. How many eggs in 3 boxes?", "12*3 = 36 eggs.\n#### 36"),
    ("Sam reads 7 pages a day for 5 days. Pages read?", "7*5 = 35 pages.\n#### 35"),
    ("Half of 18 is what?", "18/2 = 9.\n#### 9"),
    ("What is 10 minus 7?", "10-7 = 3.\n#### 3"),
    ("How many legs do 3 dogs have?", "Each dog has 4 legs, 3*4 = 12.\n#### 12"),
    ("A pen costs $2. Cost of 6 pens?", "6*2 = $12.\n#### 12"),
]


def chat(q: str, a: str, system: bool = False) -> list[dict]:
    msgs = [{"role": "system", "content": "Solve it."}] if system else []
    return msgs + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def good_rows() -> list[dict]:
    rows = [{"id": f"r{i}", "messages": chat(q, a, system=i % 2 == 0)} for i, (q, a) in enumerate(QA)]
    # a multi-turn row: only its final assistant turn is supervised under mask_history
    rows.append(
        {
            "id": "multi",
            "messages": chat("What is 1+1?", "1+1 = 2.\n#### 2") + chat("And times 4?", "2*4 = 8.\n#### 8"),
        }
    )
    return rows


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def settings_for(tmp_path: Path, source, **dataset):
    ds = {"path_or_dataset_id": str(source), "prepared_dir": str(tmp_path / "prepared"), "seq_length": 128}
    ds.update(dataset)
    return load_settings(tokenizer={"train_vocab_size": 300}, dataset=ds)


@pytest.fixture(scope="module")
def gsm8k_prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k") / "prepared"
    s = load_settings(
        Path(__file__).parents[2] / "params" / "tiny_mdlm.yaml", dataset={"prepared_dir": str(out)}
    )
    return s, prepare(s)


# ---- embedded GSM8K -----------------------------------------------------------------------------


def test_gsm8k_hash_verified(tmp_path):
    path = gsm8k_path()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GSM8K_SHA256
    rows = load_gsm8k_rows()
    assert len(rows) == 1319
    assert all(r["messages"][-1]["content"].split("\n")[-1].startswith("#### ") for r in rows)
    assert all("<<" not in r["messages"][-1]["content"] for r in rows)  # calculator notes stripped
    tampered = tmp_path / "test.jsonl"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    tampered.write_bytes(bytes(data))
    with pytest.raises(UserError, match="sha256"):
        load_gsm8k_rows(tampered)


def test_split_is_deterministic_and_by_question():
    rows = load_gsm8k_rows()
    a = split_rows(rows, 0.25, None)
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    b = split_rows(shuffled, 0.25, None)
    for name in ("train", "eval"):
        assert {r["id"] for r in a[name]} == {r["id"] for r in b[name]}
    # reference: the first 8 bytes of sha256(question) as a fraction of 2^64
    for r in rows[:50]:
        q = r["messages"][0]["content"]
        frac = int.from_bytes(hashlib.sha256(q.encode()).digest()[:8], "big") / 2**64
        assert (r in a["eval"]) == (frac < 0.25)
    assert 0.2 < len(a["eval"]) / len(rows) < 0.3
    assert len(split_rows(rows, 0.25, 100)["train"]) == 100


def test_gsm8k_prepare_counts_and_answers(gsm8k_prepared):
    s, m = gsm8k_prepared
    kept = m["splits"]["train"]["rows"] + m["splits"]["eval"]["rows"]
    assert kept + m["dropped"]["truncated"] == 1319
    assert m["source"]["sha256"] == GSM8K_SHA256
    assert m["tokenizer"]["vocab_size"] == 512
    ds = PreparedDataset(s.dataset.prepared_dir, "eval")
    assert len(ds) == m["splits"]["eval"]["rows"]
    assert all(len(ds[i]["input_ids"]) <= s.dataset.seq_length for i in range(len(ds)))
    assert all(r["answer"].split("\n")[-1].startswith("#### ") for r in ds.rows(limit=20))


# ---- supervision masks --------------------------------------------------------------------------


def test_loss_mask_is_final_assistant_turn_plus_eos(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", good_rows())
    s = settings_for(tmp_path, src, eval_fraction=0.0)
    prepare(s)
    tok = load_tokenizer(s.dataset.prepared_dir)
    ds = PreparedDataset(s.dataset.prepared_dir, "train")
    assert len(ds) == len(good_rows())
    rows = {r["id"]: r for r in ds.rows()}
    for i in range(len(ds)):
        item = ds[i]
        ids, mask = item["input_ids"], item["loss_mask"]
        messages = rows[item["id"]]["messages"]
        # reference: the prompt is the chat before the final turn rendered with a generation prompt
        prompt = tok.apply_chat_template(
            messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompt = list(prompt["input_ids"])
        assert ids[: len(prompt)] == prompt
        assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        assert item["prompt_length"] == len(prompt)
        assert ids[-1] == tok.eos_token_id
        assert tok.decode(ids[len(prompt) : -1]) == messages[-1]["content"]


def test_mask_history_false_supervises_every_assistant_turn(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", good_rows())
    s = settings_for(tmp_path, src, eval_fraction=0.0, mask_history=False)
    prepare(s)
    tok = load_tokenizer(s.dataset.prepared_dir)
    ds = PreparedDataset(s.dataset.prepared_dir, "train")
    item = next(ds[i] for i in range(len(ds)) if ds[i]["id"] == "multi")
    ids, mask = item["input_ids"], item["loss_mask"]
    runs = []
    for t, m in enumerate(mask):
        if m and (t == 0 or not mask[t - 1]):
            runs.append([t, t])
        if m:
            runs[-1][1] = t
    assert len(runs) == 2
    assert [tok.decode(ids[a:b]) for a, b in runs] == ["1+1 = 2.\n#### 2", "2*4 = 8.\n#### 8"]
    assert all(ids[b] == tok.eos_token_id for _, b in runs)


def test_template_without_generation_tags_gives_same_mask(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", good_rows())
    s = settings_for(tmp_path, src, eval_fraction=0.0)
    prepare(s)
    tok = load_tokenizer(s.dataset.prepared_dir)
    tagged = [encode_chat(tok, r["messages"], mask_history=False) for r in good_rows()]
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    untagged = [encode_chat(tok, r["messages"], mask_history=False) for r in good_rows()]
    assert tagged == untagged


# ---- drops and errors ---------------------------------------------------------------------------


def test_truncation_drop_or_cut(tmp_path):
    long_answer = " ".join(["step"] * 200) + "\n#### 1"
    rows = good_rows() + [{"id": "long", "messages": chat("Long one?", long_answer)}]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    m = prepare(settings_for(tmp_path, src, eval_fraction=0.0, seq_length=64))
    assert m["dropped"]["truncated"] == 1 and m["splits"]["train"]["rows"] == len(rows) - 1
    s = settings_for(tmp_path, src, eval_fraction=0.0, seq_length=64, drop_truncated=False)
    m = prepare(s)
    assert m["dropped"]["truncated"] == 0
    ds = PreparedDataset(s.dataset.prepared_dir, "train")
    item = next(ds[i] for i in range(len(ds)) if ds[i]["id"] == "long")
    assert len(item["input_ids"]) == 64 and item["loss_mask"][-1] == 1


def test_malformed_and_empty_rows_counted(tmp_path):
    bad = [
        "{not json",
        {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "q"}]},
        {"messages": "nope"},
        {"other": 1},
        {"messages": []},
        {"messages": chat("q?", "   ")},
    ]
    src = write_jsonl(tmp_path / "chat.jsonl", good_rows() + bad)
    m = prepare(settings_for(tmp_path, src, eval_fraction=0.0))
    assert m["dropped"]["malformed"] == 6 and m["dropped"]["empty"] == 2
    assert sum(m["dropped_reasons"].values()) == 8
    assert m["splits"]["train"]["rows"] == len(good_rows())
    assert m["source"]["rows_read"] == len(good_rows()) + len(bad)


def test_jsonl_and_parquet_inputs_agree(tmp_path):
    rows = good_rows()
    jl = write_jsonl(tmp_path / "in" / "chat.jsonl", rows)
    pdir = tmp_path / "pq"
    pdir.mkdir()
    # messages as a nested list column in one shard and as a JSON string in the other
    pq.write_table(pa.Table.from_pylist(rows[:5]), pdir / "a.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"id": r["id"], "messages": json.dumps(r["messages"])} for r in rows[5:]]),
        pdir / "b.parquet",
    )
    assert load_chat_rows(str(pdir)).rows == load_chat_rows(str(jl)).rows
    a = settings_for(tmp_path / "a", jl, eval_fraction=0.0)
    b = settings_for(tmp_path / "b", pdir, eval_fraction=0.0)
    prepare(a), prepare(b)
    da, db = PreparedDataset(a.dataset.prepared_dir), PreparedDataset(b.dataset.prepared_dir)
    assert [da[i] for i in range(len(da))] == [db[i] for i in range(len(db))]


def test_no_usable_row_is_an_error_naming_the_file(tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", ["{oops", {"messages": []}])
    with pytest.raises(UserError, match="bad.jsonl"):
        prepare(settings_for(tmp_path, src))
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(UserError, match="empty.jsonl"):
        prepare(settings_for(tmp_path, empty))
    with pytest.raises(UserError, match="no such file"):
        prepare(settings_for(tmp_path, tmp_path / "missing.jsonl"))
    assert not (tmp_path / "prepared").exists()


def test_seq_length_shorter_than_prompts(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", good_rows())
    s = settings_for(tmp_path, src, eval_fraction=0.0)
    before = prepare(s)
    with pytest.raises(UserError, match="dataset.seq_length"):
        prepare(settings_for(tmp_path, src, eval_fraction=0.0, seq_length=4))
    # nothing half-written: the earlier output is intact and no temp dir is left behind
    assert json.loads((tmp_path / "prepared" / "manifest.json").read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "prepared"]


# ---- reuse, CLI, tokenizers ---------------------------------------------------------------------


def test_reuse_when_unchanged_rebuild_when_changed(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", good_rows())
    s = settings_for(tmp_path, src)
    first = prepare(s)
    manifest = tmp_path / "prepared" / "manifest.json"
    stamp = manifest.stat().st_ino, manifest.stat().st_mtime_ns
    assert prepare(s) == first
    assert (manifest.stat().st_ino, manifest.stat().st_mtime_ns) == stamp
    forced = prepare(s, force=True)
    assert forced["content_hash"] == first["content_hash"]  # same inputs, same bytes
    assert manifest.stat().st_ino != stamp[0]
    # a changed source file or setting changes the fingerprint
    write_jsonl(src, good_rows()[:-1])
    changed = prepare(s)
    assert changed["fingerprint"] != first["fingerprint"]
    assert prepare(settings_for(tmp_path, src, seq_length=100))["fingerprint"] != changed["fingerprint"]


def test_cli_prepare(tmp_path, capsys):
    src = write_jsonl(tmp_path / "chat.jsonl", good_rows())
    yaml_path = tmp_path / "p.yaml"
    yaml_path.write_text(
        f"tokenizer: {{train_vocab_size: 300}}\n"
        f"dataset: {{path_or_dataset_id: {src}, prepared_dir: {tmp_path / 'out'}, eval_fraction: 0.0}}\n"
    )
    assert cli_main(["prepare", "--params", str(yaml_path)]) == 0
    out = capsys.readouterr().out
    assert "train" in out and f"{len(good_rows())} rows" in out
    assert (tmp_path / "out" / "manifest.json").is_file()
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"dataset: {{path_or_dataset_id: {tmp_path / 'none.jsonl'}, prepared_dir: {tmp_path / 'x'}}}\n"
    )
    assert cli_main(["prepare", "--params", str(bad)]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_pretrained_tokenizer_gets_a_mask_token(tmp_path):
    from transformers import PreTrainedTokenizerFast

    src = write_jsonl(tmp_path / "chat.jsonl", good_rows())
    prepare(settings_for(tmp_path, src, eval_fraction=0.0))
    base = load_tokenizer(tmp_path / "prepared")
    # a "foreign" tokenizer: same vocabulary, no mask token, no chat template
    plain = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, eos_token="<eos>", pad_token="<pad>"
    )
    plain.save_pretrained(tmp_path / "plain")
    s = load_settings(
        tokenizer={"name_or_path": str(tmp_path / "plain"), "mask_token": "<|mask|>"},
        dataset={"path_or_dataset_id": str(src), "prepared_dir": str(tmp_path / "p2"), "eval_fraction": 0.0},
    )
    m = prepare(s)
    tok = load_tokenizer(tmp_path / "p2")
    assert tok.mask_token == "<|mask|>" and tok.mask_token_id == m["tokenizer"]["mask_token_id"]
    assert m["tokenizer"]["vocab_size"] == len(base) + 1
    assert "{% generation %}" in tok.chat_template
    # naming a mask id the vocabulary does not have is an error naming the field
    bad = load_settings(
        tokenizer={"name_or_path": str(tmp_path / "plain")},
        dllm={"mode": "mdlm", "mask_token_id": 10**6},
        dataset={"path_or_dataset_id": str(src), "prepared_dir": str(tmp_path / "p3")},
    )
    with pytest.raises(UserError, match="dllm.mask_token_id"):
        prepare(bad)
    with pytest.raises(UserError, match="tokenizer.name_or_path"):
        prepare(
            load_settings(
                tokenizer={"name_or_path": str(tmp_path / "nope")},
                dataset={"prepared_dir": str(tmp_path / "p4")},
            )
        )


def test_prepared_dataset_errors(tmp_path):
    with pytest.raises(UserError, match="dllmflow prepare"):
        PreparedDataset(tmp_path / "nothing", "train")
    src = write_jsonl(tmp_path / "chat.jsonl", good_rows())
    prepare(settings_for(tmp_path, src))
    with pytest.raises(UserError, match="choose one of"):
        PreparedDataset(tmp_path / "prepared", "validation")
    shutil.rmtree(tmp_path / "prepared" / "tokenizer")
    with pytest.raises(UserError, match="dllmflow prepare"):
        load_tokenizer(tmp_path / "prepared")


def test_hf_datasets_path_with_split_slice(tmp_path):
    from dllmflow.data.chat import _load_hf

    # `datasets.load_dataset` on a local folder runs the same code path as a hub id, offline
    write_jsonl(tmp_path / "hf" / "train.jsonl", good_rows() + [{"messages": "broken"}])
    src = _load_hf(str(tmp_path / "hf"), "train[:3]", None, "messages")
    assert [r["id"] for r in src.rows] == ["r0", "r1", "r2"]
    src = _load_hf(str(tmp_path / "hf"), "train", None, "messages")
    assert len(src.rows) == len(good_rows()) and sum(src.dropped.values()) == 1
    with pytest.raises(UserError, match="dataset.messages_column"):
        _load_hf(str(tmp_path / "hf"), "train", None, "conversation")
    with pytest.raises(UserError, match="someorg/missing"):
        load_chat_rows("someorg/missing")  # offline in tests: a clear error, not a traceback


def test_trained_bpe_is_lossless_and_splits_digits(gsm8k_prepared):
    s, m = gsm8k_prepared
    tok = load_tokenizer(s.dataset.prepared_dir)
    assert len(tok) == s.tokenizer.train_vocab_size
    assert [tok.mask_token, tok.pad_token, tok.eos_token] == ["<mask>", "<pad>", "<eos>"]
    assert m["tokenizer"]["mask_token_id"] == tok.mask_token_id
    ids = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("12345")
    for r in PreparedDataset(s.dataset.prepared_dir, "train").rows(limit=50):
        text = r["messages"][0]["content"] + " " + r["answer"]
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
