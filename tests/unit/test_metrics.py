"""`dllmflow.training.metrics`: the metrics.jsonl log (append, torn lines, cut back on resume), the
console line, and the throughput / MFU numbers the trainer logs (checked on a 2-step tiny run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllmflow.runs import read_metrics
from dllmflow.settings import load_settings
from dllmflow.training.metrics import MetricsLog, console_line, memory_gib

ROOT = Path(__file__).resolve().parents[2]


def test_log_appends_records_and_writes_non_finite_values_as_json(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "loss": torch.tensor(2.5), "grad_norm": float("nan")})
    log.write({"step": 2, "loss": 2.0, "grad_norm": float("inf")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "loss": 2.5, "grad_norm": None},
        {"step": 2, "loss": 2.0, "grad_norm": "inf"},
    ]
    MetricsLog(tmp_path / "off.jsonl", enabled=False).write({"step": 1})  # other ranks write nothing
    assert not (tmp_path / "off.jsonl").exists()


def test_read_skips_a_torn_line_and_truncate_cuts_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 6):
        log.write({"step": step, "loss": 10.0 - step})
    with path.open("a") as f:
        f.write('{"step": 6, "lo')  # a writer killed mid-line
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    log.truncate_after(3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert not list(tmp_path.glob("*.tmp"))
    log.write({"step": 4, "loss": 0.5})  # the resumed run continues the same file
    assert [(r["step"], r["loss"]) for r in read_metrics(path)][-2:] == [(3, 7.0), (4, 0.5)]


def test_console_line_formats_each_known_key():
    rec = {"step": 7, "epoch": 1.5, "loss": 2.34567, "lr": 3e-4, "mem": 1.25, "tps": 12345.6, "mode": "mdlm"}
    assert console_line(rec, 10) == (
        "step 7/10 | epoch 1.50 | loss 2.3457 | lr 3.000e-04 | mem 1.25 GiB | tps 12,346 | mdlm"
    )
    assert console_line({"step": 1, "mfu": 12.0}).startswith("step 1 | epoch 0.00 | mfu 12.0000")


def test_memory_on_cpu_is_the_peak_rss_in_gib():
    import resource

    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert memory_gib(torch.device("cpu")) == pytest.approx(rss_kib / 2**20, rel=0.05)


@pytest.mark.slow  # a real (2-step) training run: ~5 s of CPU
def test_trainer_logs_tps_and_mfu_from_the_step_tokens_and_model_size(tmp_path):
    """mfu = 100 · 6 · num_params · tokens_per_step / step_time / world / peak, tps = tokens / step_time:
    so mfu = 100 · 6 · num_params · tps / 1e12 / peak whatever the step time was."""
    from dllmflow.data.prepare import prepare
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.models.build import build_model
    from dllmflow.training.trainer import run_training

    peak = 0.5
    settings = load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        dataset={"prepared_dir": str(tmp_path / "prep"), "limit": 16, "seq_length": 128},
        train={"max_steps": 2, "global_batch_size": 4, "local_batch_size": 2, "peak_tflops": peak},
        checkpoint={"every_steps": 2},
    )
    prepare(settings)
    run_training(settings, tmp_path / "run")
    num_params = sum(p.numel() for p in build_model(settings, load_tokenizer(tmp_path / "prep")).parameters())
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 2
    for rec in records:
        assert rec["tps"] > 0 and rec["tokens_per_step"] > 0
        assert rec["mfu"] == pytest.approx(100 * 6 * num_params * rec["tps"] / 1e12 / peak, rel=1e-9)
