"""Golden-trajectory guard: the first optimizer steps of every tiny recipe reproduce recorded numbers.

Each `tests/golden/<case>.json` holds the per-step loss and grad norm of 10 optimizer steps of
`params/tiny_<mode>.yaml` (16 GSM8K rows, seq 256, global batch 4 = 2 micro-batches of 2, lr 1e-2,
seed 0), run in float64 (`train.dtype: float64`: a float64 model, every float32 upcast kept in float64;
the corruption noise is drawn exactly as in a float32 run). `idlm_shifted.json` is the I-DLM recipe at
seq 320, where the block-shifted attention kernel (models/shifted_attention.py, used above L = 256)
takes part. One recording per case, the same check on every machine: rel 1e-9 on every step.

Why float64 and 1e-9 (measured on an AMD AVX512 CPU, torch 2.13, 2026-05): in float32 the trajectory
moves with the CPU (reduction order follows the SIMD width; between an AVX2 and an AVX512 recording:
step 1 within 9e-7, up to 4e-5 in loss and 1.3e-3 in grad norm by step 9), so the old fallback for an
unrecorded kind (1e-3 loss, 1e-2 grad norm) let real changes through. In float64 the same reordering
moves the numbers by about 1e-16 per op; measured amplification over the 10 steps: float64 with 1 vs 2
intra-op threads is bit-identical for all six modes, and changing the attention kernel (eager
matmul+softmax vs SDPA, same math, other reduction order) moves the float64 trajectory by at most
1.0e-15 (mdlm, idlm; 5.5e-8 to 2.1e-7 in float32). The smallest change the guard must catch moves it by 2.3e-5
(`test_golden_catches_small_optimizer_changes`: lr +0.5 % 5.7e-4 in loss, weight decay 0.01 5.7e-5,
Adam beta2 0.99 1.5e-4, max_grad_norm -1 % 2.3e-5; grad norms 4.2e-3, 9.0e-4, 1.4e-3, 2.8e-4), so
1e-9 sits orders of magnitude above rounding and below every change. A change that moves the numbers
on purpose regenerates them in the same commit and says why:

    pytest tests/golden --update-golden      # rewrites every tests/golden/<case>.json from this code
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dllmflow.models import split_attention
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent
STEPS = 10
REL = 1e-9  # float64; see the module docstring for the measurements behind it


@dataclass(frozen=True)
class Case:
    mode: str
    seq_length: int = 256
    settings: dict = field(default_factory=dict)


CASES = {
    "mdlm": Case("mdlm"),
    "scdd": Case("scdd"),
    "hybrid": Case("hybrid"),
    "block_diffusion": Case("block_diffusion"),
    "dflash": Case("dflash"),
    "idlm": Case("idlm"),
    # Halves of 320 tokens > split_attention.MASKED_MAX_LEN: the mask-free block-shifted kernel runs.
    "idlm_shifted": Case("idlm", seq_length=320),
    "block_causal": Case("block_causal"),
    # next-token + lookahead: recorded before causal blocks left block_causal (block_attention: causal)
    "causal_blocks": Case("causal_blocks"),
    "ar": Case("ar"),  # the AR control's causal next-token SFT
    "uno": Case("uno"),  # the drafting adapter on a frozen tiny causal LM
}
# The four optimizer changes the guard must see (each measured above), applied to the mdlm case.
CHANGES = {
    "lr +0.5%": {"lr": 1.005e-2},
    "weight_decay 0.01": {"weight_decay": 0.01},
    "adam beta2 0.99": {"betas": [0.9, 0.99]},
    "max_grad_norm -1%": {"max_grad_norm": 0.99},
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Prepared datasets by seq length (the tiny recipes share the embedded GSM8K and the trained BPE)."""
    from dllmflow.data.prepare import prepare

    cache: dict[int, Path] = {}

    def get(seq_length: int) -> Path:
        if seq_length not in cache:
            out = tmp_path_factory.mktemp(f"golden-prepared-{seq_length}") / "tiny"
            prepare(load_settings(ROOT / "params" / "tiny_mdlm.yaml", **_data(out, seq_length)))
            cache[seq_length] = out
        return cache[seq_length]

    return get


def _data(prepared: Path, seq_length: int) -> dict:
    return {"dataset": {"limit": 16, "seq_length": seq_length, "prepared_dir": str(prepared)}}


def _trajectory(case: Case, prepared: Path, tmp: Path, **train) -> dict[str, list[float]]:
    from dllmflow.runs import read_metrics
    from dllmflow.training.trainer import run_training

    overrides = {
        **_data(prepared, case.seq_length),
        "train": {
            "max_steps": STEPS,
            "global_batch_size": 4,
            "local_batch_size": 2,
            "lr": 1e-2,
            "warmup_steps": 2,
            "seed": 0,
            "dtype": "float64",
            **train,
        },
        "checkpoint": {"every_steps": STEPS, "keep_last": 1, "save_consolidated": "false"},
        **case.settings,
    }
    if case.mode == "dflash":
        overrides["dflash"] = {"target_model_id": f"tiny:{tmp / 'target'}", "target_torch_dtype": "float64"}
    settings = load_settings(ROOT / "params" / f"tiny_{case.mode}.yaml", **overrides)
    torch.manual_seed(1234)  # the trainer must not depend on the caller's global RNG
    result = run_training(settings, tmp / "run")
    records = read_metrics(result.metrics_path)
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}


def deviation(got: dict, want: dict) -> dict[str, float]:
    """Largest relative difference per series over the steps."""
    return {
        k: max(abs(g - w) / abs(w) for g, w in zip(got[k], want[k], strict=True))
        for k in ("loss", "grad_norm")
    }


def read_golden(name: str) -> dict:
    data = json.loads((GOLDEN / f"{name}.json").read_text())
    assert data["dtype"] == "float64" and len(data["loss"]) == len(data["grad_norm"]) == STEPS, name
    return data


def _write_golden(name: str, case: Case, got: dict) -> None:
    machine = f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} torch-{torch.__version__}"
    record = {"mode": case.mode, "seq_length": case.seq_length, "steps": STEPS, "dtype": "float64",
              "recorded_on": machine, **got}  # fmt: skip
    (GOLDEN / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


@pytest.mark.parametrize("name", list(CASES))
def test_golden_trajectory(name, prepared, tmp_path, request, monkeypatch):
    case = CASES[name]
    calls = []
    if name == "idlm_shifted":  # prove the kernel this case exists for takes part (the real one, counted)
        kernel = split_attention.block_shifted_attention
        monkeypatch.setattr(
            split_attention, "block_shifted_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
        )
    got = _trajectory(case, prepared(case.seq_length), tmp_path)
    assert len(got["loss"]) == STEPS
    if name == "idlm_shifted":
        assert calls, "no micro-batch reached the block-shifted attention: raise the case's seq_length"
    if request.config.getoption("--update-golden"):
        _write_golden(name, case, got)
    dev = deviation(got, read_golden(name))
    assert max(dev.values()) <= REL, (
        f"{name} moved from tests/golden/{name}.json: max rel deviation {dev} > {REL}"
    )


@pytest.mark.parametrize("change", list(CHANGES))
def test_golden_catches_small_optimizer_changes(change, prepared, tmp_path):
    """Each change moves the float64 mdlm trajectory far beyond REL (the measured deviations: module docstring)."""
    got = _trajectory(CASES["mdlm"], prepared(256), tmp_path, **CHANGES[change])
    dev = deviation(got, read_golden("mdlm"))
    assert max(dev.values()) > 1e4 * REL, f"{change} moved the trajectory only by {dev}"
