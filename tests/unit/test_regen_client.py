"""Unit tests of `dllmflow regenerate` (`dllmflow.data.regen_client` and its parts `regen_input`,
`regen_shards`, `regen_http`): prompt extraction, input slicing, shard scanning, manifest rules, atomic
shard writing, payloads, backoff, retries (Retry-After, via in-process servers) and CLI/YAML settings.
The requests themselves are tested against the real local server in
tests/integration/test_regenerate_server.py; foreign output dirs in tests/faults/test_regen_output_dir.py."""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import json
import random
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dllmflow.data import regen_client as rg
from dllmflow.data import regen_http as rh
from dllmflow.data import regen_input as inp
from dllmflow.data import regen_shards as shards
from dllmflow.errors import UserError
from dllmflow.settings import RegenerateConfig

U = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}
S = {"role": "system", "content": "s"}


def cfg(tmp_path, **kw) -> RegenerateConfig:
    base = {
        "input_data": "in.jsonl",
        "output_dir": str(tmp_path / "out"),
        "target_server": "http://x/v1",
        "model": "m",
    }
    return RegenerateConfig(**{**base, **kw})


# ---- prompt extraction --------------------------------------------------------------------------


def test_drops_all_trailing_assistant_turns_keeps_earlier_ones():
    u2 = {"role": "user", "content": "q2"}
    assert inp.extract_prompt([S, U, A, u2, A, {"role": "assistant", "content": "again"}]) == [S, U, A, u2]
    assert inp.extract_prompt([U]) == [U]
    assert inp.extract_prompt([U, A]) == [U]


@pytest.mark.parametrize("messages", [[], [A], [S, A, A], [S], "not json", None, [{"content": "no role"}]])
def test_rows_without_a_user_turn_are_rejected(messages):
    assert inp.extract_prompt(messages) is None


def test_json_string_chats_and_parquet_nulls():
    # Prepared data stores chats as JSON strings; parquet fills absent struct fields with None.
    assert inp.extract_prompt(json.dumps([U, A])) == [U]
    assert inp.extract_prompt([{**U, "reasoning_content": None}, A]) == [U]


def test_build_prompts_counts_skipped_rows_and_keeps_input_order():
    rows = [{"messages": [U, A]}, {"messages": [S, A]}, {"messages": [{"role": "user", "content": "z"}]}]
    prompts, skipped = inp.build_prompts(rows, "messages", "x")
    assert skipped == 1
    assert [p.index for p in prompts] == [0, 2]
    assert prompts[0].original == [U, A]


def test_missing_messages_column_names_it():
    with pytest.raises(UserError, match="--messages-column 'chat'.*columns: \\['messages'\\]"):
        inp.build_prompts([{"messages": [U]}], "chat", "x.jsonl")


# ---- input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "split,expected",
    [("train", list(range(10))), ("train[:3]", [0, 1, 2]), ("train[7:]", [7, 8, 9]), ("train[-2:]", [8, 9]),
     ("train[10%:30%]", [1, 2]), ("test[2:4]", [2, 3])],
)  # fmt: skip
def test_split_slices_local_rows(tmp_path, split, expected):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"i": i, "messages": [U]}) for i in range(10)) + "\n")
    assert [r["i"] for r in inp.load_rows(str(path), split)] == expected


def test_bad_split_syntax_names_the_flag():
    with pytest.raises(UserError, match="--split"):
        inp.parse_split("train[1:2")


def test_shuffle_seed_permutes_before_slicing(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"i": i}) for i in range(20)))
    a = [r["i"] for r in inp.load_rows(str(path), "train[:5]", shuffle_seed=3)]
    full = [r["i"] for r in inp.load_rows(str(path), "train", shuffle_seed=3)]
    assert a == full[:5] and sorted(full) == list(range(20)) and full != list(range(20))
    assert a == [r["i"] for r in inp.load_rows(str(path), "train[:5]", shuffle_seed=3)]


def test_loads_parquet_dir_json_array_and_reports_bad_lines(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for k in range(2):
        pq.write_table(
            pa.Table.from_pylist([{"i": 2 * k + j, "messages": [U]} for j in range(2)]), d / f"s{k}.parquet"
        )
    (d / "manifest.json").write_text("{}")  # not data
    assert [r["i"] for r in inp.load_rows(str(d))] == [0, 1, 2, 3]
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([{"i": 5}, {"i": 6}]))
    assert [r["i"] for r in inp.load_rows(str(arr))] == [5, 6]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"i": 1}\n{oops\n')
    with pytest.raises(UserError, match="bad.jsonl:2"):
        inp.load_rows(str(bad))
    with pytest.raises(UserError, match="no such file"):
        inp.load_rows(str(tmp_path / "missing.jsonl"))


# ---- shards and manifest ------------------------------------------------------------------------


def test_scan_shards_ignores_other_files_and_missing_dir(tmp_path):
    assert shards.scan_shards(tmp_path / "nope") == set()
    for name in ["shard-000000.parquet", "shard-000003.parquet", "shard-000001.parquet.tmp", "shard-1.parquet",
                 "shard-0000002.parquet", "manifest.json", "xshard-000004.parquet"]:  # fmt: skip
        (tmp_path / name).write_text("")
    assert shards.scan_shards(tmp_path) == {0, 3}


def test_manifest_holds_content_settings_only(tmp_path):
    m = shards.build_manifest(cfg(tmp_path, concurrency=7, timeout_s=5, max_retries=9))
    assert set(m) == {"input_data", "target_server", "model", "messages_column", "split", "dataset_name",
                      "shuffle_seed", "shard_size", "max_new_tokens", "temperature", "top_p", "reasoning",
                      "seed"}  # fmt: skip
    assert m == shards.build_manifest(cfg(tmp_path, output_dir="elsewhere"))  # output_dir and knobs excluded


def test_fresh_run_into_empty_dir_writes_manifest(tmp_path):
    c = cfg(tmp_path)
    assert shards.prepare_output_dir(c.output_dir, shards.build_manifest(c), resume=False) == set()
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == shards.build_manifest(c)
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_fresh_run_refuses_existing_shards(tmp_path):
    # A regeneration output (its manifest is there) with a shard: a fresh run would mix two runs.
    c = cfg(tmp_path)
    shards.prepare_output_dir(c.output_dir, shards.build_manifest(c), resume=False)
    (tmp_path / "out" / "shard-000000.parquet").write_text("")
    with pytest.raises(UserError, match="already holds 1 shard.*--resume"):
        shards.prepare_output_dir(c.output_dir, shards.build_manifest(c), resume=False)


def test_resume_rules(tmp_path):
    c = cfg(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-000002.parquet").write_text("")
    with pytest.raises(UserError, match="no manifest.json"):
        shards.prepare_output_dir(out, shards.build_manifest(c), resume=True)
    (out / "manifest.json").write_text(json.dumps(shards.build_manifest(c)))
    assert shards.prepare_output_dir(out, shards.build_manifest(c), resume=True) == {2}
    # Operational knobs may change on resume; content settings may not, and the message names them.
    knobs = cfg(tmp_path, concurrency=1, timeout_s=1, max_retries=0)
    assert shards.prepare_output_dir(out, shards.build_manifest(knobs), resume=True) == {2}
    changed = cfg(tmp_path, temperature=0.8, model="other")
    with pytest.raises(
        UserError, match=r"model: 'm' \(manifest\) vs 'other'.*temperature: 0.0 \(manifest\) vs 0.8"
    ):
        shards.prepare_output_dir(out, shards.build_manifest(changed), resume=True)


def test_seed_is_recorded_and_a_manifest_from_before_seed_still_resumes(tmp_path):
    out = tmp_path / "out"
    assert shards.build_manifest(cfg(tmp_path, seed=3))["seed"] == 3
    old = {k: v for k, v in shards.build_manifest(cfg(tmp_path)).items() if k != "seed"}  # unseeded, older
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps(old))
    (out / "shard-000000.parquet").write_text("")
    assert shards.prepare_output_dir(out, shards.build_manifest(cfg(tmp_path)), resume=True) == {0}
    with pytest.raises(UserError, match=r"seed: None \(manifest\) vs 3 \(now\)"):
        shards.prepare_output_dir(out, shards.build_manifest(cfg(tmp_path, seed=3)), resume=True)


def test_write_shard_is_atomic_and_round_trips(tmp_path):
    rows = [
        {"messages": [U, {**A, "reasoning_content": "think"}], "original_messages": [U, A]},
        {"messages": [U, A], "original_messages": [U, A, A]},
    ]
    path = shards.write_shard(tmp_path, 7, rows, with_reasoning=True)
    assert path.name == "shard-000007.parquet" and shards.scan_shards(tmp_path) == {7}
    assert [p.name for p in tmp_path.iterdir()] == ["shard-000007.parquet"]  # no tmp left behind
    back = pq.read_table(path).to_pylist()
    assert back[0]["messages"][1] == {**A, "reasoning_content": "think"}
    assert back[1]["messages"][1] == {**A, "reasoning_content": None}
    assert back[1]["original_messages"] == [U, A, A]
    plain = shards.write_shard(tmp_path, 8, [rows[1]], with_reasoning=False)
    assert pq.read_table(plain).column_names == ["messages", "original_messages"]
    assert pq.read_table(plain).to_pylist()[0]["messages"] == [U, A]


# ---- requests -----------------------------------------------------------------------------------


def test_backoff_is_capped_exponential():
    assert [rh.backoff_s(a) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert [rh.backoff_s(a, base=0.01, cap=0.03) for a in range(3)] == [0.01, 0.02, 0.03]


def test_retry_after_parses_seconds_and_http_dates():
    now = 1_445_412_480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert rh.retry_after_s("7") == 7.0 and rh.retry_after_s(" 1.5 ") == 1.5
    assert rh.retry_after_s("Wed, 21 Oct 2015 07:28:30 GMT", now=now) == 30.0
    assert rh.retry_after_s("Wed, 21 Oct 2015 07:27:00 GMT", now=now) == 0.0  # already past
    assert rh.retry_after_s("-3") == 0.0
    assert (
        rh.retry_after_s(None) is None and rh.retry_after_s("") is None and rh.retry_after_s("soon") is None
    )


def test_retry_wait_jitters_backoff_and_honours_retry_after():
    rng = random.Random(0)
    waits = [rh.retry_wait_s(a, None, 1.0, 30.0, rng) for a in range(7) for _ in range(20)]
    for a in range(7):
        chunk = waits[a * 20 : (a + 1) * 20]
        full = rh.backoff_s(a)
        assert all(full / 2 <= w <= full for w in chunk) and len(set(chunk)) > 1  # jittered, in range
    assert rh.retry_wait_s(0, 12.0, 0.01, 30.0, rng) == 12.0  # longer than the backoff: the server wins
    assert 8.0 <= rh.retry_wait_s(4, 0.5, 1.0, 30.0, rng) <= 16.0  # shorter: the backoff wins
    assert rh.retry_wait_s(0, 1e9, 0.01, 30.0, rng) == rh.MAX_RETRY_AFTER_S


def _post(handler, max_retries: int = 3):
    """post_chat against an in-process httpx transport; returns (reply or error, sleeps, counters)."""
    import httpx

    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await rh.post_chat(
                client, "http://x/v1/chat/completions", {"model": "m"}, max_retries=max_retries,
                backoff_base_s=0.01, backoff_cap_s=0.05, counters=counters, sleep=fake_sleep,
                rng=random.Random(0),
            )  # fmt: skip

    counters = rh.Counters()
    try:
        result = asyncio.run(go())
    except rh.RequestFailed as e:
        result = e
    return result, sleeps, counters


REPLY = {"choices": [{"message": {"role": "assistant", "content": "ok"}}]}


def test_429_with_retry_after_waits_what_the_server_asked():
    import httpx

    answers = iter(
        [
            httpx.Response(429, headers={"Retry-After": "3"}, text="slow down"),
            httpx.Response(
                503, headers={"Retry-After": email.utils.formatdate(time.time() + 60, usegmt=True)}
            ),
            httpx.Response(500),  # no Retry-After: the jittered backoff (attempt 2: 0.02..0.04 s)
            httpx.Response(200, json=REPLY),
        ]
    )
    reply, sleeps, counters = _post(lambda request: next(answers))
    assert reply == REPLY
    assert sleeps[0] == 3.0 and 55.0 < sleeps[1] <= 60.0 and 0.02 <= sleeps[2] <= 0.04
    assert (counters.requests, counters.retries) == (4, 3)


def test_retries_exhausted_and_4xx_not_retried():
    import httpx

    failed, sleeps, counters = _post(
        lambda r: httpx.Response(429, headers={"Retry-After": "1"}), max_retries=2
    )
    assert (
        isinstance(failed, rh.RequestFailed)
        and "failed after 3 attempts" in str(failed)
        and "429" in str(failed)
    )
    assert sleeps == [1.0, 1.0] and counters.requests == 3
    failed, sleeps, counters = _post(lambda r: httpx.Response(400, text="bad"))
    assert isinstance(failed, rh.RequestFailed) and "HTTP 400" in str(failed)
    assert sleeps == [] and counters.requests == 1


def test_regenerate_honours_retry_after_from_a_real_http_server(tmp_path, monkeypatch):
    """End to end over a socket: a stdlib server answers the first chat request 429 + Retry-After."""
    import http.server
    import threading

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"data": [{"id": "m"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            hits.append(self.path)
            if len(hits) == 1:
                self._send(429, {"error": "busy"}, {"Retry-After": "2"})
            else:
                self._send(200, REPLY)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    monkeypatch.setattr(rh, "_sleep", fake_sleep)
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": [U, A]}) + "\n")
    try:
        summary = rg.regenerate(
            cfg(tmp_path, input_data=str(data), target_server=f"http://127.0.0.1:{server.server_port}/v1"),
            progress=False, backoff_base_s=0.01,
        )  # fmt: skip
    finally:
        server.shutdown()
    assert sleeps == [2.0] and summary["retries"] == 1 and summary["rows_written"] == 1
    assert hits == ["/v1/chat/completions"] * 2


def test_payload_and_reasoning_modes(tmp_path):
    p = rh.build_payload(cfg(tmp_path, max_new_tokens=5, temperature=0.8, top_p=0.9), [U])
    assert p == {"model": "m", "messages": [U], "max_tokens": 5, "temperature": 0.8, "top_p": 0.9}
    off = rh.build_payload(cfg(tmp_path, reasoning="disable"), [U])
    assert off["chat_template_kwargs"] == {"enable_thinking": False} and "extra_body" not in off
    assert "chat_template_kwargs" not in rh.build_payload(cfg(tmp_path, reasoning="save"), [U])


def test_seeded_payloads_derive_the_seed_from_the_run_seed_and_the_row_index(tmp_path):
    seeded = cfg(tmp_path, temperature=0.8, seed=0)
    seeds = [rh.build_payload(seeded, [U], i)["seed"] for i in range(50)]
    assert len(set(seeds)) == 50 and all(0 <= s < 2**63 for s in seeds)  # one int64 per row
    assert seeds == [rh.row_seed(0, i) for i in range(50)]  # a pure function: stable across runs
    assert rh.build_payload(cfg(tmp_path, temperature=0.8, seed=1), [U], 0)["seed"] != seeds[0]
    assert "seed" not in rh.build_payload(cfg(tmp_path, temperature=0.8), [U], 3)  # unseeded: as before


def test_assistant_turn_keeps_reasoning_only_when_saved():
    reply = {"choices": [{"message": {"role": "assistant", "content": "x", "reasoning_content": "r"}}]}
    assert rh.assistant_turn(reply, "save") == {"role": "assistant", "content": "x", "reasoning_content": "r"}
    assert rh.assistant_turn(reply, "none") == {"role": "assistant", "content": "x"}
    empty = {"choices": [{"message": {"content": None, "reasoning_content": ""}}]}
    assert rh.assistant_turn(empty, "save") == {"role": "assistant", "content": ""}


def test_api_key_from_env(monkeypatch):
    monkeypatch.delenv("DLLMFLOW_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert rh.api_key_from_env() is None
    monkeypatch.setenv("OPENAI_API_KEY", "o")
    assert rh.api_key_from_env() == "o"
    monkeypatch.setenv("DLLMFLOW_API_KEY", "d")
    assert rh.api_key_from_env() == "d"


# ---- settings: flags over YAML ------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    rg.add_cli_args(p)
    return p.parse_args(list(argv))


def test_flags_override_params_yaml(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text("regenerate:\n  input_data: a.jsonl\n  model: t\n  shard_size: 7\n  temperature: 0.8\n")
    c = rg.config_from_args(parse("--params", str(params), "--shard-size", "3", "--reasoning", "disable"))
    assert c.seed is None and rg.config_from_args(parse("--params", str(params), "--seed", "7")).seed == 7
    assert (c.input_data, c.model, c.shard_size, c.temperature, c.reasoning) == (
        "a.jsonl",
        "t",
        3,
        0.8,
        "disable",
    )
    assert c.target_server == rg.DEFAULT_TARGET_SERVER and c.concurrency == 32  # code defaults


@pytest.mark.parametrize(
    "flag,value", [("--shard-size", "0"), ("--concurrency", "0"), ("--max-new-tokens", "0"), ("--top-p", "0"),
                   ("--timeout-s", "0"), ("--max-retries", "-1"), ("--temperature", "-0.5")],
)  # fmt: skip
def test_invalid_flags_name_the_flag(flag, value):
    with pytest.raises(UserError, match=f"^{flag}"):
        rg.config_from_args(parse(flag, value))


def test_required_settings_are_named(tmp_path):
    with pytest.raises(UserError, match="--input-data"):
        rg.regenerate(RegenerateConfig(model="m", target_server="http://x/v1"))
    with pytest.raises(UserError, match="--model"):
        rg.regenerate(RegenerateConfig(input_data="x", target_server="http://x/v1"))
    with pytest.raises(UserError, match="--target-server"):
        rg.regenerate(RegenerateConfig(input_data="x", model="m"))
