"""`dllmflow regenerate` against the real local server (`dllmflow serve` in a subprocess) on a tiny random
causal LM with a chat template: end to end, kill + resume, injected 500/429 failures, clear errors.
No mocks: every request goes over HTTP to a real model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from _serving import build_tiny_chat_lm, fault_server
from dllmflow.cli import main
from dllmflow.common.net import free_port
from dllmflow.data.regen_shards import scan_shards

pytestmark = pytest.mark.slow  # servers in subprocesses

MODEL = "tiny-target"
API_KEY = "sk-test-secret-4242"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_lm(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def server(model_dir):
    # A little latency per request so concurrent requests overlap and a run can be killed mid-way.
    with fault_server(model_dir, served_model_name=MODEL, delay_s=0.05) as url:
        yield url


def stats(url: str, api_key: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}  # /stats is behind the key too
    return httpx.get(url.removesuffix("/v1") + "/stats", headers=headers).json()


def settled_stats(url: str, quiet_s: float = 0.5, timeout_s: float = 30.0) -> dict:
    """/stats once the server is idle: a killed client's last request may still be in flight (or not yet
    counted: its body is parsed off the event loop) when the client dies."""
    deadline = time.monotonic() + timeout_s
    last = stats(url)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = stats(url)
        if now["in_flight"] == 0 and now["requests"] == last["requests"]:
            return now
        last = now
    raise AssertionError(f"server never went idle: {last}")


def injected(url: str) -> int:
    """Chat requests the fault middleware (tests/_serving.py) has failed so far."""
    return httpx.get(url.removesuffix("/v1") + "/faults").json()["injected_failures"]


def chat_rows(n: int, invalid_at: tuple[int, ...] = ()) -> list[dict]:
    rows = []
    for i in range(n):
        if i in invalid_at:  # no user turn: skipped and counted
            rows.append(
                {
                    "id": i,
                    "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
                }
            )
            continue
        msgs = [{"role": "user", "content": f"question {i}: Natalia sold {i} clips"}]
        if i % 3 == 1:  # multi-turn: the earlier assistant turn is kept
            msgs += [{"role": "assistant", "content": "earlier"}, {"role": "user", "content": f"and {i}?"}]
        msgs += [{"role": "assistant", "content": f"old answer {i}"}] * (1 + i % 2)  # 1 or 2 trailing
        rows.append({"id": i, "messages": msgs})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def expected_prompt(messages: list[dict]) -> list[dict]:
    end = len(messages)
    while messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def read_shards(out: Path) -> list[list[dict]]:
    return [pq.read_table(out / f"shard-{i:06d}.parquet").to_pylist() for i in sorted(scan_shards(out))]


def args(inp: Path, out: Path, url: str, *extra: str) -> list[str]:
    return ["regenerate", "--input-data", str(inp), "--output-dir", str(out), "--target-server", url,
            "--model", MODEL, "--max-new-tokens", "4", "--no-progress", "--backoff-base-s", "0.01", *extra]  # fmt: skip


def run(capsys, argv: list[str]) -> tuple[int, dict | None, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    lines = [ln for ln in cap.out.splitlines() if ln.startswith("{")]
    return rc, (json.loads(lines[-1]) if lines else None), cap.err


def test_end_to_end_shards_load_back(server, tmp_path, capsys):
    rows = chat_rows(11, invalid_at=(5,))
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    before = stats(server)
    rc, summary, _ = run(capsys, args(inp, out, server, "--shard-size", "3", "--concurrency", "3"))
    assert rc == 0
    assert (summary["rows_written"], summary["rows_skipped"], summary["rows_failed"]) == (10, 1, 0)
    assert stats(server)["requests"] - before["requests"] == 10
    assert stats(server)["max_in_flight"] <= 3  # --concurrency bounds the requests in flight

    shards = read_shards(out)
    assert [len(s) for s in shards] == [3, 3, 3, 1]
    got = [r for s in shards for r in s]
    usable = [r for r in rows if r["id"] != 5]
    for row, src in zip(got, usable):  # input order, prompt + one new assistant turn, original untouched
        assert row["messages"][:-1] == expected_prompt(src["messages"])
        assert row["messages"][-1]["role"] == "assistant" and isinstance(row["messages"][-1]["content"], str)
        assert row["original_messages"] == src["messages"]
    assert any(r["messages"][-1]["content"] for r in got)  # the tiny model does produce text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shard_size"] == 3 and "concurrency" not in manifest and "output_dir" not in manifest
    assert not list(out.glob("*.tmp"))


def test_params_yaml_defaults_and_flag_overrides(server, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    params = tmp_path / "p.yaml"
    params.write_text(
        f"regenerate:\n  input_data: {inp}\n  target_server: {server}\n  model: {MODEL}\n"
        f"  output_dir: {tmp_path / 'yaml_out'}\n  shard_size: 1\n  max_new_tokens: 3\n"
    )
    rc, summary, _ = run(
        capsys, ["regenerate", "--params", str(params), "--shard-size", "2", "--no-progress"]
    )
    assert rc == 0 and summary["shards_written"] == 2
    manifest = json.loads((tmp_path / "yaml_out" / "manifest.json").read_text())
    assert (manifest["shard_size"], manifest["max_new_tokens"]) == (2, 3)


def test_kill_mid_run_then_resume_loses_and_duplicates_nothing(server, tmp_path, capsys):
    n, k = 24, 3
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(n))
    out, ref = tmp_path / "out", tmp_path / "ref"
    common = ["--shard-size", str(k), "--concurrency", "1"]
    cmd = [sys.executable, "-m", "dllmflow.cli", *args(inp, out, server, *common)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not scan_shards(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    done = scan_shards(out)
    assert done and len(done) < n // k, f"kill did not land mid-run: {sorted(done)}"

    before = settled_stats(server)
    rc, summary, _ = run(capsys, args(inp, out, server, *common, "--resume"))
    assert rc == 0
    assert summary["shards_resumed"] == len(done) and summary["rows_resumed"] == k * len(done)
    # Finished shards are not requested again.
    assert stats(server)["requests"] - before["requests"] == n - k * len(done)

    assert run(capsys, args(inp, ref, server, *common))[0] == 0  # uninterrupted reference
    resumed = [r for s in read_shards(out) for r in s]
    reference = [r for s in read_shards(ref) for r in s]
    assert len(resumed) == n
    assert [r["messages"][:-1] for r in resumed] == [r["messages"][:-1] for r in reference]
    assert [r["original_messages"] for r in resumed] == [r["original_messages"] for r in reference]
    assert len({json.dumps(r["original_messages"]) for r in resumed}) == n  # no duplicates
    # Greedy decoding, one request at a time: the answers match too.
    assert [r["messages"][-1] for r in resumed] == [r["messages"][-1] for r in reference]


def test_seeded_sampling_reproduces_the_shards_byte_for_byte(server, tmp_path, capsys):
    """`--seed` with sampling: a run at another concurrency, and a resume that regenerates a lost shard,
    write exactly the same bytes; another seed writes other answers."""
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(12, invalid_at=(4,)))
    sampled = ["--shard-size", "4", "--temperature", "0.8", "--max-new-tokens", "12"]

    def regen(out: Path, seed: str, concurrency: str, *extra: str) -> None:
        rc, _, err = run(
            capsys, [*args(inp, out, server, *sampled, "--seed", seed, "--concurrency", concurrency), *extra]
        )
        assert rc == 0, err

    regen(a := tmp_path / "a", "0", "8")
    regen(b := tmp_path / "b", "0", "1")
    (b / "shard-000001.parquet").unlink()  # lost: the resume requests its rows again
    regen(b, "0", "3", "--resume")
    regen(c := tmp_path / "c", "1", "8")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and len(names) == 4  # 3 shards + manifest
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert json.loads((a / "manifest.json").read_text())["seed"] == 0
    answers = [[r["messages"][-1]["content"] for s in read_shards(o) for r in s] for o in (a, c)]
    assert answers[0] != answers[1] and any(answers[0])


def test_injected_failures_abort_without_partial_shard_then_retries_succeed(
    model_dir, tmp_path, capsys, monkeypatch
):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    out = tmp_path / "out"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("DLLMFLOW_API_KEY", raising=False)
    # Failures 1-2 (500, 500) exhaust --max-retries 1; failures 3-4 (429, 500) are retried on resume.
    with fault_server(model_dir, served_model_name=MODEL, fail_first=4, fail_status=[500, 500, 429, 500],
                      api_key=API_KEY) as url:  # fmt: skip
        rc, _, err = run(capsys, args(inp, out, url, "--shard-size", "2", "--concurrency", "1"))
        assert rc == 2 and "API key" in err and "DLLMFLOW_API_KEY" in err  # the server wants a Bearer token

        monkeypatch.setenv("DLLMFLOW_API_KEY", API_KEY)
        rc, summary, err = run(
            capsys,
            args(
                inp,
                out,
                url,
                "--shard-size",
                "2",
                "--concurrency",
                "1",
                "--max-retries",
                "1",
                "--log-level",
                "DEBUG",
            ),
        )
        assert rc == 1 and "failed after 2 attempts" in err and "HTTP 500" in err
        assert summary["aborted"] and summary["rows_failed"] == 1 and summary["rows_written"] == 0
        assert scan_shards(out) == set() and not list(out.glob("*.tmp"))  # nothing partial written
        assert API_KEY not in err
        assert injected(url) == 2

        rc, summary, err = run(
            capsys, args(inp, out, url, "--shard-size", "2", "--concurrency", "1", "--resume")
        )
        assert rc == 0 and summary["retries"] == 2 and summary["rows_written"] == 4
        assert injected(url) == 4
        assert [len(s) for s in read_shards(out)] == [2, 2]
        assert API_KEY not in err


def test_fresh_run_into_non_empty_dir_and_manifest_mismatch_are_refused(server, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    out = tmp_path / "out"
    assert run(capsys, args(inp, out, server))[0] == 0
    rc, _, err = run(capsys, args(inp, out, server))
    assert rc == 2 and "already holds 1 shard" in err and "--resume" in err
    rc, _, err = run(capsys, args(inp, out, server, "--resume", "--temperature", "0.8"))
    assert rc == 2 and "temperature: 0.0 (manifest) vs 0.8 (now)" in err
    (out / "manifest.json").unlink()
    rc, _, err = run(capsys, args(inp, out, server, "--resume"))
    assert rc == 2 and "no manifest.json" in err


def test_no_usable_prompts_exits_1(server, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3, invalid_at=(0, 1, 2)))
    rc, _, err = run(capsys, args(inp, tmp_path / "out", server))
    assert rc == 1 and "none of its 3 rows has a user turn" in err
    assert scan_shards(tmp_path / "out") == set()


def test_unreachable_server_and_unknown_model_are_clear_errors(server, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    dead = f"http://127.0.0.1:{free_port()}/v1"
    rc, _, err = run(capsys, args(inp, tmp_path / "a", dead))
    assert rc == 2 and f"--target-server {dead}: cannot reach it" in err
    argv = args(inp, tmp_path / "b", server)
    argv[argv.index(MODEL)] = "no-such-model"
    rc, _, err = run(capsys, argv)
    assert rc == 2 and "--model 'no-such-model' is not served" in err and MODEL in err


def test_server_endpoints(server):
    assert httpx.get(server.removesuffix("/v1") + "/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(f"{server}/models").json()["data"]] == [MODEL]
    bad = httpx.post(f"{server}/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0.7,
    }
    too_long = httpx.post(f"{server}/chat/completions", json={**body, "max_tokens": 510})
    assert too_long.status_code == 400 and "max_model_len (512)" in too_long.json()["error"]["message"]
    reply = httpx.post(f"{server}/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] <= 3


def test_library_call_with_a_local_server_url_resumes_across_ports(server, tmp_path):
    """A flow's local server gets a fresh port each time: with target_server unset and the URL passed as
    server_url, the manifest does not pin the port, so a resume still matches."""
    from dllmflow.data.regen_client import regenerate
    from dllmflow.settings import RegenerateConfig

    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    cfg = RegenerateConfig(
        input_data=str(inp), output_dir=str(tmp_path / "out"), model=MODEL, max_new_tokens=3
    )
    first = regenerate(cfg, server_url=server, progress=False)
    assert first["rows_written"] == 3
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["target_server"] is None
    other_url = server.replace("127.0.0.1", "localhost")  # same server, another spelling
    again = regenerate(cfg, server_url=other_url, resume=True, progress=False)
    assert (again["rows_written"], again["rows_resumed"], again["requests"]) == (0, 3, 0)


def test_a_rejected_request_is_not_retried(server, tmp_path, capsys):
    """4xx other than 429 means the request itself is wrong: one attempt, then abort (exit 1)."""
    inp = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    before = stats(server)["requests"]
    argv = args(inp, tmp_path / "out", server, "--max-retries", "3")
    argv[argv.index("--max-new-tokens") + 1] = "600"  # > the tiny model's 512 positions
    rc, summary, err = run(capsys, argv)
    assert rc == 1 and "rejected the request: HTTP 400" in err and "max_tokens" in err
    assert stats(server)["requests"] - before == 1 and summary["retries"] == 0
    assert scan_shards(tmp_path / "out") == set()
