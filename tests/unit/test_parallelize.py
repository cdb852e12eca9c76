"""Meta-device build, activation checkpointing, mixed precision and compile (training/parallelize.py,
models/meta.py), on one CPU process.

  * the meta build + seeded replay gives bit-identical weights and buffers to the eager build, for
    every backbone (Qwen3 mdlm/idlm, hybrid adapter, DiffusionGemma, DFlash draft) and a pretrained dir;
  * activation checkpointing (full, selective) leaves loss and gradients unchanged (fp32);
  * train.dtype=bfloat16 trains on CPU (autocast) with a finite, falling loss;
  * the golden mdlm trajectory (float64) holds with train.compile on (backend aot_eager: inductor's C++
    build takes minutes on this 2-core machine, so the test uses the graph-capture path without codegen);
  * train.dtype=float64 is the CPU reference only; train.autocast_dtype is refused, naming train.dtype.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _dflash_common import NUM_WORDS, make_batch, make_settings, make_tokenizer

from dllmflow.diffusion.modes import MODES, build_mode_model
from dllmflow.diffusion.seeding import sample_seed
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.errors import UserError
from dllmflow.settings import load_settings
from dllmflow.settings.loader import SettingsError
from dllmflow.training.distributed import DistInfo
from dllmflow.training.parallelize import apply_ac, build_parallel_model, check_dtype

ROOT = Path(__file__).resolve().parents[2]
CPU = DistInfo(0, 0, 1, torch.device("cpu"), False)
VOCAB = NUM_WORDS + 3  # make_tokenizer(): words + <pad> <eos> <mask>


def _settings(mode: str, **overrides):
    dllm = {"vocab_size": VOCAB} if mode in ("block_diffusion", "scdd") else {}
    if mode == "idlm":
        dllm["mask_token_id"] = NUM_WORDS + 2
    return load_settings(ROOT / "params" / f"tiny_{mode}.yaml", dllm=dllm, **overrides)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not bad, bad[:5]
    bufs = dict(b.named_buffers())
    assert [n for n, x in a.named_buffers() if not torch.equal(x, bufs[n])] == []


def _eager_and_meta(strategy, tok, settings):
    torch.manual_seed(settings.train.seed)
    eager = build_mode_model(settings, tok)
    after = torch.get_rng_state()
    torch.manual_seed(settings.train.seed)
    built = build_parallel_model(tok, settings, CPU)
    assert torch.equal(after, torch.get_rng_state())  # the RNG ends where the eager build leaves it
    return eager, built


@pytest.mark.parametrize("mode", ["mdlm", "hybrid", "idlm", "block_diffusion"])
def test_meta_build_equals_eager_build(mode):
    settings, tok = _settings(mode), make_tokenizer()
    eager, built = _eager_and_meta(build_strategy(settings), tok, settings)
    assert not any(p.is_meta for p in built.parameters())
    _same(eager, built)
    if hasattr(built, "lm_head") and settings.model.tiny.tie_word_embeddings:
        assert built.lm_head.weight is built.get_input_embeddings().weight  # still tied


def test_meta_build_equals_eager_build_dflash_draft(tmp_path):
    settings, tok = make_settings(tmp_path / "target"), make_tokenizer()
    eager, built = _eager_and_meta(build_strategy(settings), tok, settings)
    _same(eager, built)


def test_pretrained_dir_loads_into_the_meta_skeleton(tmp_path):
    tok = make_tokenizer()
    torch.manual_seed(3)
    MODES["mdlm"].build_model(_settings("mdlm"), tok).save_pretrained(tmp_path / "base")
    settings = load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        model={"tiny": None, "pretrained_model_name_or_path": str(tmp_path / "base")},
    )
    eager, built = _eager_and_meta(build_strategy(settings), tok, settings)
    _same(eager, built)


# ---- activation checkpointing -------------------------------------------------------------------------


def _loss_and_grads(mode: str, ac: str, tmp_path: Path):
    tok = make_tokenizer()
    if mode == "dflash":
        settings = make_settings(tmp_path / "target")
    else:
        settings = _settings(mode, dataset={"seq_length": 32})
    strategy = build_strategy(settings)
    torch.manual_seed(0)
    model = build_parallel_model(tok, settings, CPU)
    apply_ac(model, ac)
    strategy.setup(model, tok, torch.device("cpu"))
    batch = make_batch(bsz=2, seq_len=32 if mode == "block_diffusion" else 24)
    batch.update(strategy.corrupt(batch, [sample_seed(0, 0, i) for i in range(2)]))
    out = strategy.loss(model.train(), batch)
    total = sum(out.weight(k) * s for k, s in out.sums.items())
    total.backward()
    return float(total.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("mode", ["mdlm", "hybrid", "block_diffusion", "dflash"])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpointing_keeps_loss_and_grads(mode, ac, tmp_path):
    loss, grads = _loss_and_grads(mode, "none", tmp_path)
    loss_ac, grads_ac = _loss_and_grads(mode, ac, tmp_path)
    assert loss_ac == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == grads_ac.keys() and grads
    for name, g in grads.items():
        torch.testing.assert_close(grads_ac[name], g, rtol=1e-6, atol=1e-9, msg=name)


# ---- mixed precision and compile ------------------------------------------------------------------------


def test_dtype_settings_are_checked(monkeypatch):
    with pytest.raises(SettingsError, match="train.dtype"):
        load_settings(ROOT / "params" / "tiny_mdlm.yaml", train={"dtype": "float16"})
    with pytest.raises(SettingsError, match=r"train.autocast_dtype was removed: set train.dtype: bfloat16"):
        load_settings(ROOT / "params" / "tiny_mdlm.yaml", train={"autocast_dtype": "bfloat16"})
    f64 = load_settings(ROOT / "params" / "tiny_mdlm.yaml", train={"dtype": "float64"})
    check_dtype(f64, torch.device("cpu"))
    with pytest.raises(UserError, match=r"train.dtype=float64 is the CPU reference mode"):
        check_dtype(f64, torch.device("meta"))
    settings = load_settings(ROOT / "params" / "tiny_mdlm.yaml", train={"dtype": "bfloat16"})
    check_dtype(settings, torch.device("cpu"))  # this CPU computes in bf16

    def no_bf16(*args, **kwargs):
        raise RuntimeError("bf16 matmul not supported")

    monkeypatch.setattr(torch.Tensor, "__matmul__", no_bf16)
    with pytest.raises(UserError, match=r"train.dtype=bfloat16.*set train.dtype: float32"):
        check_dtype(settings, torch.device("cpu"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    from dllmflow.data.prepare import prepare

    out = tmp_path_factory.mktemp("prepared") / "tiny"
    prepare(load_settings(ROOT / "params" / "tiny_mdlm.yaml", **_golden_data(out)))
    return out


def _golden_data(prepared: Path) -> dict:
    return {"dataset": {"limit": 16, "seq_length": 256, "prepared_dir": str(prepared)}}


def _run(prepared: Path, run_dir: Path, steps: int, **train):
    """The golden mdlm recipe (tests/golden/test_golden.py) for `steps` steps."""
    from dllmflow.training.trainer import run_training

    settings = load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        **_golden_data(prepared),
        train={
            "max_steps": steps,
            "global_batch_size": 4,
            "local_batch_size": 2,
            "lr": 1e-2,
            "warmup_steps": 2,
            "seed": 0,
            **train,
        },
        checkpoint={"every_steps": steps, "keep_last": 1, "save_consolidated": "false"},
    )
    return run_training(settings, run_dir).losses


def test_bfloat16_trains_on_cpu(prepared, tmp_path):
    losses = _run(prepared, tmp_path / "bf16", 8, dtype="bfloat16", activation_checkpointing="full")
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


def test_golden_mdlm_holds_with_compile(prepared, tmp_path):
    """The float64 golden recording (one for every machine) holds for the compiled blocks too."""
    golden = json.loads((ROOT / "tests" / "golden" / "mdlm.json").read_text())
    assert golden["dtype"] == "float64"
    got = _run(prepared, tmp_path / "compiled", 3, compile=True, compile_backend="aot_eager", dtype="float64")
    assert got == pytest.approx(golden["loss"][:3], rel=1e-9)
