"""Golden-loss guard: the first optimizer steps of every tiny recipe reproduce recorded numbers.

Each `tests/golden/<mode>.json` holds the per-step loss and grad norm of 10 optimizer steps of
`params/tiny_<mode>.yaml` (16 GSM8K rows, seq 256, global batch 4 = 2 micro-batches of 2, seed 0),
recorded from the code at the time, once per machine kind (`machine_fingerprint`: CPU vendor and the
SIMD level torch dispatches to, torch version, threads), since float32 reductions round differently
on different CPUs. On a kind it was recorded on, a refactor must reproduce that recording to 1e-6
relative. On any other kind, rounding differences grow with every update (measured between the first
recording and an AVX2 AMD one: step 1 within 9e-7, then up to 4e-5 in loss and 1.3e-3 in grad norm
by step 9, block_diffusion), so the check is step 1 to 1e-5 and the trajectory to 1e-3 (loss) and
1e-2 (grad norm), with a warning naming the missing kind; a change of the math moves step 1 itself
by far more. A change that moves the numbers on purpose regenerates them in the same commit and says
why:

    pytest tests/golden --update-golden   # record this machine kind; drops recordings the code left
"""

from __future__ import annotations

import json
import platform
import warnings
from pathlib import Path

import pytest
import torch

from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent
MODES = ("mdlm", "scdd", "hybrid", "block_diffusion", "dflash", "idlm")
STEPS = 10
REL = 1e-6  # against this machine kind's own recording
# Against another kind's: step 1 (no update has amplified rounding yet), then the whole trajectory.
CROSS_FIRST_STEP_REL = 1e-5
CROSS_REL = {"loss": 1e-3, "grad_norm": 1e-2}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """One prepared dataset (the tiny recipes share the embedded GSM8K and the trained BPE)."""
    from dllmflow.data.prepare import prepare

    out = tmp_path_factory.mktemp("golden-prepared") / "tiny"
    prepare(load_settings(ROOT / "params" / "tiny_mdlm.yaml", **_data(out)))
    return out


def _data(prepared: Path) -> dict:
    return {"dataset": {"limit": 16, "seq_length": 256, "prepared_dir": str(prepared)}}


def _trajectory(mode: str, prepared: Path, tmp: Path) -> dict[str, list[float]]:
    from dllmflow.runs import read_metrics
    from dllmflow.training.trainer import run_training

    overrides = {
        **_data(prepared),
        "train": {
            "max_steps": STEPS,
            "global_batch_size": 4,
            "local_batch_size": 2,
            "lr": 1e-2,
            "warmup_steps": 2,
            "seed": 0,
        },
        "checkpoint": {"every_steps": STEPS, "keep_last": 1, "save_consolidated": "false"},
    }
    if mode == "dflash":
        overrides["dflash"] = {"target_model_id": f"tiny:{tmp / 'target'}"}
    settings = load_settings(ROOT / "params" / f"tiny_{mode}.yaml", **overrides)
    torch.manual_seed(1234)  # the trainer must not depend on the caller's global RNG
    result = run_training(settings, tmp / "run")
    records = read_metrics(result.metrics_path)
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}


def machine_fingerprint() -> str:
    """What float32 results depend on besides the code: CPU vendor, the SIMD level ATen dispatches to
    (and MKL with it), torch version, intra-op threads."""
    vendor = platform.processor() or "?"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        vendor = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in cpuinfo.read_text().splitlines()
                if ln.startswith("vendor_id")
            ),
            vendor,
        )
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.machine()} {vendor} {capability} torch-{torch.__version__} threads-{torch.get_num_threads()}"


def _cross_machine_mismatch(got: dict, want: dict) -> str | None:
    """Why `got` cannot be `want` recorded on another machine kind, or None."""
    for key, rel in CROSS_REL.items():
        if got[key][0] != pytest.approx(want[key][0], rel=CROSS_FIRST_STEP_REL):
            return f"{key} at step 1: {got[key][0]} vs {want[key][0]} (rel {CROSS_FIRST_STEP_REL})"
        if got[key] != pytest.approx(want[key], rel=rel):
            return f"{key}: {got[key]} vs {want[key]} (rel {rel})"
    return None


@pytest.mark.parametrize("mode", MODES)
def test_golden_losses(mode, prepared, tmp_path, request):
    got = _trajectory(mode, prepared, tmp_path)
    path = GOLDEN / f"{mode}.json"
    here = machine_fingerprint()
    if request.config.getoption("--update-golden"):
        old = json.loads(path.read_text())["recordings"] if path.is_file() else []
        # Other kinds' recordings stay while they agree with this one: the code did not move them.
        kept = [r for r in old if r["machine"] != here and _cross_machine_mismatch(got, r) is None]
        recordings = [{"machine": here, **got}, *kept]
        path.write_text(json.dumps({"mode": mode, "steps": STEPS, "recordings": recordings}, indent=1) + "\n")
    recordings = json.loads(path.read_text())["recordings"]
    assert all(len(r["loss"]) == STEPS for r in recordings) and len(got["loss"]) == STEPS
    own = next((r for r in recordings if r["machine"] == here), None)
    if own is not None:
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(own[key], rel=REL), (
                f"{mode} {key} moved from tests/golden/{path.name} (recorded on this machine kind: {here})"
            )
        return
    warnings.warn(
        f"tests/golden/{path.name} has no recording for {here!r}: compared across machine kinds "
        "(`pytest tests/golden --update-golden` on this kind adds one)",
        stacklevel=1,
    )
    for r in recordings:
        why = _cross_machine_mismatch(got, r)
        assert why is None, f"{mode} moved from tests/golden/{path.name} (recorded on {r['machine']}): {why}"
