"""Concurrent use: registrations racing on a fresh SQLite MLflow store all land with distinct versions
(the store is created/migrated once, under a file lock: `tracking.mlflow_run.connect`) and each with
the one dataset input they all log (`tracking.dataset_input`), and two flow
runs of one recipe never share a run dir (`runs.flow_run_dir` is keyed by the Metaflow run id)."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from dllmflow.runs import flow_run_dir

NAME = "conc-test"
NUM_PROCS = 3
DATA_HASH = "0123456789abcdef" * 4


def test_two_flow_runs_of_one_recipe_get_distinct_run_dirs(tmp_path):
    a, b = flow_run_dir(tmp_path / "tiny_mdlm", "1712"), flow_run_dir(tmp_path / "tiny_mdlm", "1713")
    assert a != b and a.parent == b.parent == tmp_path / "tiny_mdlm"
    assert flow_run_dir(tmp_path / "tiny_mdlm", "1712") == a  # a resumed run (origin id) finds its own


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished run in miniature: settings.json and a tiny consolidated checkpoint with its tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dllmflow.data.tokenizer import train_bpe_tokenizer
    from dllmflow.settings import load_settings

    run = tmp_path_factory.mktemp("run")
    tok = train_bpe_tokenizer(["What is 2 + 3? 5"] * 5, 300, "<mask>", "<pad>", "<eos>")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(run / "consolidated")
    tok.save_pretrained(run / "consolidated")
    settings = load_settings(model={"tiny": {}})
    settings.write_json(run / "consolidated" / "settings.json")
    settings.write_json(run / "settings.json")
    # Prepared data's manifest: each registration logs the same dataset input (one row, raced for).
    (run / "prepared").mkdir()
    (run / "prepared" / "manifest.json").write_text(json.dumps({"content_hash": DATA_HASH}))
    return run


def _register(uri: str, run_dir: str, queue) -> None:
    """One `dllmflow register`, in its own process: log the run, register its checkpoint."""
    try:
        from dllmflow.settings import load_settings
        from dllmflow.tracking import mlflow_run, registry

        s = load_settings(
            model={"tiny": {}},
            registry={"tracking_uri": uri, "model_name": NAME},
            dataset={"prepared_dir": str(Path(run_dir) / "prepared")},
        )
        run_id = mlflow_run.log_run(s, run_dir)
        version = registry.register_model(
            s, run_id, Path(run_dir) / "consolidated", sampler="llada", sampler_settings={"steps": 2}
        )
        queue.put(("ok", run_id, int(version.version)))
    except BaseException as e:  # reported to the parent, which names it
        queue.put(("error", type(e).__name__, str(e)[:2000]))


def test_concurrent_registrations_on_a_fresh_sqlite_store_all_land(tmp_path, run_dir):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # fresh: the first opens race on the migration
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_register, args=(uri, str(run_dir), queue)) for _ in range(NUM_PROCS)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors
    run_ids, versions = {r[1] for r in results}, sorted(r[2] for r in results)
    assert len(run_ids) == NUM_PROCS and versions == list(range(1, NUM_PROCS + 1))
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    registered = client.search_model_versions(f"name='{NAME}'")
    assert sorted(int(v.version) for v in registered) == versions
    for run_id in run_ids:  # each run names the one dataset as its input
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert [i.dataset.digest for i in inputs] == [DATA_HASH[:32]]
