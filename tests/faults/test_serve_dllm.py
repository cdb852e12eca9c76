"""`dllmflow serve` for a dLLM, end to end: a tiny export registered in a SQLite MLflow store and served
from `models:/<name>@champion` in a subprocess. The official `openai` client works (chat and text,
streamed and not); a stream delivers one event per committed block; `usage` carries NFE; requests with
the same settings are batched and answer as they do alone; a bad sampler override is a 400 naming it;
`/v1/models` reports the lineage; hostile bodies are refused and the server keeps serving; a client gone
mid-stream leaves its batch at the next turn; a bad registry URI or `--sampler-setting` is one line and
exit 2, a good `--sampler-setting` is what the server decodes with, on `--threads` threads. One server
for the module (~45 s for the file on 2 busy cores, most of it MLflow's store and the server start)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from dllmflow.inference.serve_cli import local_server
from dllmflow.settings import load_settings

pytestmark = pytest.mark.slow  # servers in subprocesses

NAME = "dllmflow-serve-test"
RECORDED = {"steps": 12, "max_new_tokens": 12, "block_size": 4}  # 3 blocks of 4 new tokens
TEXTS = ["Natalia sold 48 clips in April and half as many in May. #### 72", "What is 2 + 3? The answer is 5."]
HI = [{"role": "user", "content": "What is 2 + 3?"}]
PROMPTS = ["What is 2 + 3?", "Natalia sold 48 clips", "Hi", "half as many in May, what is 48 + 24?"]


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """(tracking uri, export dir): a tiny random dLLM export registered as NAME, alias champion."""
    import mlflow
    import torch
    from mlflow import MlflowClient

    from dllmflow.data.tokenizer import train_bpe_tokenizer
    from dllmflow.models.build import build_model
    from dllmflow.tracking.registry import register_model

    tmp = tmp_path_factory.mktemp("serve_dllm")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    tok = train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")
    settings = load_settings(
        model={"tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}},
        registry={"tracking_uri": uri, "model_name": NAME},
    )
    torch.manual_seed(0)
    export = tmp / "export"
    build_model(settings, tok).save_pretrained(export)
    tok.save_pretrained(export)
    settings.write_json(export / "settings.json")
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as run:
        run_id = run.info.run_id
    setting = {"threshold": None}
    version = register_model(
        settings, run_id, export, sampler="llada", sampler_settings=RECORDED, setting=setting
    )
    MlflowClient(uri).set_registered_model_alias(NAME, "champion", version.version)
    return uri, export, run_id, tmp


@contextlib.contextmanager
def registry_env(registered):
    """os.environ pointing at the test store and model cache while the block runs (local_server passes
    os.environ to the subprocess)."""
    uri, _, _, tmp = registered
    env = {"MLFLOW_TRACKING_URI": uri, "DLLMFLOW_MODEL_CACHE": str(tmp / "cache")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def server(registered):
    with registry_env(registered), local_server(f"models:/{NAME}@champion", max_tokens_cap=256) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def stats(url: str) -> dict:
    return httpx.get(f"{url.removesuffix('/v1')}/stats", timeout=30).json()


def test_models_reports_the_lineage(server, registered):
    _, _, run_id, _ = registered
    (card,) = client(server).models.list().data
    lineage = card.model_extra["dllmflow"]
    assert card.id == NAME and lineage["name"] == NAME and lineage["alias"] == "champion"
    assert (
        lineage["version"] == 1 and lineage["run_id"] == run_id and lineage["setting"] == {"threshold": None}
    )
    assert lineage["sampler"] == "llada" and lineage["mode"] == "mdlm"
    assert {k: lineage["sampler_settings"][k] for k in RECORDED} == RECORDED


def test_openai_client_chat_and_text_streamed_and_not(server):
    c = client(server)
    whole = c.chat.completions.create(model=NAME, messages=HI)
    assert whole.choices[0].finish_reason in ("stop", "length")
    usage = whole.usage.model_extra["dllmflow"]
    assert 1 <= usage["nfe"] <= RECORDED["steps"] and usage["sampler"] == "llada"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(
        c.chat.completions.create(
            model=NAME, messages=HI, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(deltas) == whole.choices[0].message.content  # same request, same greedy text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.model_extra["dllmflow"] == usage
    assert sum(bool(d) for d in deltas) <= 3  # at most one content event per block of 4 tokens
    text = c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8)
    assert text.object == "text_completion" and text.usage.completion_tokens <= 8
    pieces = list(c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text.choices[0].text


def test_raw_stream_sends_a_block_per_event_and_done(server):
    body = {
        "model": NAME,
        "prompt": PROMPTS[2],
        "max_tokens": 12,
        "stream": True,
        "dllmflow": {"block_size": 4},
    }
    with httpx.stream("POST", f"{server}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert len(events) <= 3 + 2  # <= 3 blocks with text, the finish event, [DONE]


def test_same_settings_are_batched_and_answer_as_alone(server):
    body = {"model": NAME, "max_tokens": 8}
    alone = [
        httpx.post(f"{server}/completions", json={**body, "prompt": p}, timeout=60).json()["choices"][0][
            "text"
        ]
        for p in PROMPTS
    ]
    before = stats(server)

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as ac:
            rs = await asyncio.gather(
                *[ac.post(f"{server}/completions", json={**body, "prompt": p}) for p in PROMPTS]
            )
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(together()) == alone
    after = stats(server)
    assert after["batches"] - before["batches"] < len(PROMPTS) and after["max_batch_size_seen"] > 1


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"dllmflow": {"thresh": 0.9}}, "dllmflow.thresh"),
        ({"dllmflow": {"threshold": 1.5}}, "dllmflow.threshold"),
        ({"dllmflow": {"cache": "dual", "use_kv_cache": True}}, "dllmflow.use_kv_cache"),
        ({"dllmflow": {"no_kv_cache": True}}, "dllmflow.no_kv_cache"),  # `cache: none` is the one spelling
        ({"dllmflow": {"sampler": "nope"}}, "dllmflow.sampler"),
        ({"dllmflow": {"steps": 10_000}}, "dllmflow.steps"),
        # strict, then capped (diffusion.samplers.asked): each of these held or crashed the server
        ({"dllmflow": {"steps": "1000000000"}}, "dllmflow.steps"),
        ({"dllmflow": {"steps": 1e9}}, "dllmflow.steps"),
        ({"dllmflow": {"steps": True}}, "dllmflow.steps"),
        ({"dllmflow": {"steps": 13}, "max_tokens": 12}, "dllmflow.steps"),  # past the generation
        ({"dllmflow": {"temperature": float("inf")}}, "temperature"),  # json sends Infinity
        ({"dllmflow": {"seed": 2**70}}, "seed"),
        ({"dllmflow": {"threshold": "0.9"}}, "dllmflow.threshold"),
        ({"seed": 2**70}, "seed"),
        ({"top_p": 0.5}, "top_p"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_bad_overrides_are_400_naming_the_field(server, extra, param):
    body = json.dumps({"model": NAME, "messages": HI, **extra})  # inf as `Infinity`, which json.loads reads
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{server}/chat/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_good_override_changes_the_decoding(server):
    c = client(server)
    plain = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12)
    fast = c.completions.create(
        model=NAME,
        prompt=PROMPTS[0],
        max_tokens=12,
        extra_body={"dllmflow": {"threshold": 0.001, "cache": "dual"}},
    )
    assert fast.usage.model_extra["dllmflow"]["nfe"] < plain.usage.model_extra["dllmflow"]["nfe"]


def test_hostile_bodies_are_refused_and_serving_goes_on(server):
    url = f"{server}/chat/completions"
    headers = {"content-type": "application/json"}
    big = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    assert httpx.post(url, content=big, headers=headers, timeout=60).status_code == 413
    many = {"model": NAME, "messages": HI * 1000}
    r = httpx.post(url, json=many, timeout=60)
    assert r.status_code == 400 and "--max-messages" in r.json()["error"]["message"]
    deep = f'{{"model": "{NAME}", "messages": {"[" * 5000 + "]" * 5000}}}'
    r = httpx.post(url, content=deep, headers=headers, timeout=60)
    assert r.status_code == 400 and "deeper" in r.json()["error"]["message"]
    assert (
        client(server).chat.completions.create(model=NAME, messages=HI, max_tokens=4).usage.completion_tokens
        <= 4
    )


def test_a_client_gone_mid_stream_leaves_its_batch_at_the_next_turn(server):
    # 256 blocks of one token: hundreds of turns if the row stayed; it leaves a turn or so after the close
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 256, "stream": True, "dllmflow": {"block_size": 1}}
    before = stats(server)
    with httpx.stream("POST", f"{server}/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line)  # the first block arrived: the row is decoding
    for _ in range(300):
        s = stats(server)
        if s["active_rows"] == 0:
            break
        time.sleep(0.02)
    assert s["active_rows"] == 0 and s["dropped"] - before["dropped"] == 1, s
    assert s["turns"] - before["turns"] < 128, (before, s)


def test_a_bad_registry_uri_is_one_line_and_exit_2(registered):
    from dllmflow.errors import UserError
    from dllmflow.inference.registered import resolve_registered

    uri, _, _, tmp = registered
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "DLLMFLOW_MODEL_CACHE": str(tmp / "cache")}
    cmd = [sys.executable, "-m", "dllmflow.cli", "serve", "--model", f"models:/{NAME}@nope", "--port", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "alias 'nope'" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    with pytest.raises(UserError, match="no version 3 of model 'nothing'"):
        resolve_registered("models:/nothing/3", uri, str(tmp / "cache"))


def test_a_recorded_trust_is_refused_without_the_callers_flag(registered):
    """A version registered with `trust_remote_code: true` is served only with `--trust-remote-code`:
    the record asks, the one who starts the server decides (one line, exit 2, before any port opens)."""
    from dllmflow.errors import UserError
    from dllmflow.inference.registered import resolve_registered
    from dllmflow.tracking.registry import register_model

    uri, export, run_id, tmp = registered
    trusting = load_settings(
        model={
            "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64},
            "trust_remote_code": True,
        },
        registry={"tracking_uri": uri, "model_name": f"{NAME}-trusting"},
    )
    register_model(trusting, run_id, export, sampler="llada", sampler_settings=RECORDED)
    target = f"models:/{NAME}-trusting/1"
    with pytest.raises(UserError, match=r"registered with trust_remote_code.*pass --trust-remote-code"):
        resolve_registered(target, uri, str(tmp / "cache"))
    assert resolve_registered(target, uri, str(tmp / "cache"), trust_remote_code=True).trust_remote_code
    # the flag alone decides for a version recorded without it, too
    assert not resolve_registered(f"models:/{NAME}/1", uri, str(tmp / "cache")).trust_remote_code
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "DLLMFLOW_MODEL_CACHE": str(tmp / "cache")}
    cmd = [sys.executable, "-m", "dllmflow.cli", "serve", "--model", target, "--port", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "--trust-remote-code" in out.stderr.strip().splitlines()[-1], out.stderr
    assert "Traceback" not in out.stderr


def test_the_loaded_pyfunc_refuses_a_nested_list(registered):
    """Through `mlflow.pyfunc.load_model` (MLflow's input handling included), `[["a", "b"]]` is refused
    naming the row, not answered as "a" (the column schema kept the first column); a list still works."""
    import mlflow

    from dllmflow.errors import UserError

    uri, _, _, _ = registered
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"models:/{NAME}/1")
    with pytest.raises(UserError, match="row 0: list, not a prompt string"):
        model.predict([["What is 2 + 3?", "and 4 + 4?"]])
    assert len(model.predict(["What is 2 + 3?", "Hi"], params={"max_new_tokens": 4, "steps": 4})) == 2


def test_a_version_that_is_not_a_dllmflow_model_is_refused(registered):
    import mlflow
    from mlflow import MlflowClient

    from dllmflow.errors import UserError
    from dllmflow.inference.registered import resolve_registered

    uri, _, _, tmp = registered
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as run:
        mlflow.log_text("not a model", "other/readme.txt")
    client = MlflowClient(uri)
    client.create_registered_model("other")
    client.create_model_version("other", f"runs:/{run.info.run_id}/other", run.info.run_id)
    with pytest.raises(UserError, match="not a dllmflow model"):
        resolve_registered("models:/other/1", uri, str(tmp / "cache"))
    with pytest.raises(UserError, match="not a registry URI"):
        resolve_registered("models:/other", uri)
    assert Path(tmp / "cache").is_dir()


@pytest.mark.parametrize(
    "item, named",
    [("steps=1e9", "steps: input should be a valid integer"), ("seed=1180591620717411303424", "seed: "),
     ("max_new_tokens=100000", "max_new_tokens: 100000 is above the cap of 1024 (--max-tokens-cap)"),
     ("temperature=inf", "temperature: "), ("temperature=.inf", "temperature: must be a finite number"),
     ("steps=64", "steps: 64 is above the generation length")],
)  # fmt: skip
def test_a_server_sampler_setting_is_checked_like_a_request(registered, item, named):
    """`--sampler-setting` goes through the requests' check, under the server's `--max-tokens-cap`,
    before any weight is read (the recorded setting decodes 12 tokens: 64 steps are past them)."""
    from dllmflow.errors import UserError
    from dllmflow.inference.dllm_engine import DllmEngine, served_from_path
    from dllmflow.inference.serve_cli import parse_sampler_settings

    _, export, _, _ = registered
    served = dataclasses.replace(served_from_path(export), sampler_settings=RECORDED)
    with pytest.raises(UserError, match="^" + re.escape(f"--sampler-setting {named}")):
        DllmEngine(served, settings=parse_sampler_settings([item]), max_tokens_cap=1024)


def test_server_sampler_settings_and_threads_are_served_and_a_bad_one_is_exit_2(registered):
    base = [sys.executable, "-m", "dllmflow.cli", "serve", "--model", f"models:/{NAME}@champion", "--port", "1"]  # fmt: skip
    bad = [
        (["--sampler-setting", "cache=triple"], "--sampler-setting cache"),
        (["--sampler-setting", "steps"], "--sampler-setting 'steps'"),
        (["--sampler-setting", "steps=1e9"], "--sampler-setting steps: input should be a valid integer"),
        (["--threads", "0"], "--threads must be >= 1"),
    ]
    with registry_env(registered):
        for flags, named in bad:
            out = subprocess.run([*base, *flags], capture_output=True, text=True, timeout=120)
            last = out.stderr.strip().splitlines()[-1]  # after the download's progress bars, if any
            assert out.returncode == 2 and last.startswith(f"dllmflow serve: error: {named}"), out.stderr
            assert "Traceback" not in out.stderr, out.stderr
        # 3 threads: neither this machine's default (its cores, or OMP_NUM_THREADS) nor CI's 1
        settings = {"cache": "dual", "steps": 6}
        with local_server(f"models:/{NAME}@champion", sampler_settings=settings, threads=3) as url:
            threads = stats(url)["threads"]
            (card,) = client(url).models.list().data
            lineage = card.model_extra["dllmflow"]
            answer = client(url).completions.create(model=NAME, prompt="What is 2 + 3?", max_tokens=12)
    assert lineage["server_settings"] == {"cache": "dual", "steps": 6}
    assert lineage["sampler_settings"]["cache"] == "dual" and lineage["sampler_settings"]["steps"] == 6
    assert lineage["setting"] == {"threshold": None}  # still the point it was gated at
    assert answer.usage.model_extra["dllmflow"]["nfe"] == 6  # the server's 6 steps, not the recorded 12
    assert threads == 3  # --threads reached the decoding


def test_by_default_the_forwards_leave_a_core_to_the_event_loop(server, monkeypatch):
    """`--threads` unset: $OMP_NUM_THREADS when set, else every usable core but one (the loop reads,
    tokenises and streams while a batch decodes)."""
    from dllmflow.inference.serve_cli import default_threads

    env = os.environ.get("OMP_NUM_THREADS")
    assert stats(server)["threads"] == (int(env) if env else max(1, len(os.sched_getaffinity(0)) - 1))
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert default_threads() == 5
    monkeypatch.delenv("OMP_NUM_THREADS")
    for cores, threads in (({0, 1, 2, 3}, 3), ({0, 1}, 1), ({0}, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores)
        assert default_threads() == threads
