"""Pretrained weights read per rank from the safetensors (models/sharded_load.py), for full and LoRA runs.

* one process: every parameter equals the checkpoint's tensor, the adapters equal the eager build's
  (`from_pretrained` + `apply_lora` from the same seed);
* 2 ranks under torchrun (FSDP2): each rank holds half the rows, and `full_tensor()` of every parameter
  equals the safetensors (slow);
* an index missing a tensor, or a tensor of another shape: one UserError naming the tensor, on every
  rank, and the ranks exit (no hang).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _sharded_ckpt import build, pretrained_settings, save_tiny_checkpoint
from safetensors.torch import load_file, save_file

from dllmflow.errors import UserError

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


def _base_name(name: str) -> str:
    return name.replace(".base_layer", "")


def _assert_equals_files(params: dict[str, torch.Tensor], ckpt: Path) -> None:
    files = load_file(ckpt / "model.safetensors")
    base = {n: p for n, p in params.items() if "lora_" not in n}
    assert {_base_name(n) for n in base} == set(files)
    for name, value in base.items():
        assert torch.equal(value, files[_base_name(name)]), name


def _assert_seeded_adapters(params: dict[str, torch.Tensor], seed: int) -> None:
    """As peft injects them from the seed, module by module: nn.Linear(in, r) and nn.Linear(r, out) each
    draw kaiming-uniform(a=sqrt(5)) at construction, then A is drawn again; B = 0."""
    import math

    def kaiming(shape):
        return torch.nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5))

    torch.manual_seed(seed)
    a_names = [n for n in params if "lora_A" in n]
    assert a_names
    for name in a_names:
        kaiming(params[name].shape), kaiming(params[name.replace("lora_A", "lora_B")].shape)
        assert torch.equal(params[name], kaiming(params[name].shape)), name
    assert all(not params[n].any() for n in params if "lora_B" in n)


@pytest.mark.parametrize("lora", [False, True])
def test_one_process_reads_the_files(ckpt, lora):
    from dllmflow.diffusion.modes import build_mode_model
    from dllmflow.models.lora import apply_lora

    model, settings, tokenizer = build(ckpt, lora, strategy="ddp")
    params = {n: p.detach() for n, p in model.named_parameters()}
    _assert_equals_files(params, ckpt)
    if lora:
        _assert_seeded_adapters(params, settings.train.seed)
    # what the rank-0 path loaded: the eager build (from_pretrained + apply_lora) from the same seed
    torch.manual_seed(settings.train.seed)
    eager = dict(apply_lora(build_mode_model(settings, tokenizer), settings).named_parameters())
    assert eager.keys() == params.keys()
    assert [n for n, p in eager.items() if not torch.equal(p, params[n])] == []


def _sharded_copy(ckpt: Path, out: Path) -> Path:
    """`ckpt` saved as 2 safetensors shards with an index."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(out, max_shard_size="20KB")
    AutoTokenizer.from_pretrained(ckpt).save_pretrained(out)
    assert (out / "model.safetensors.index.json").is_file()
    return out


def _drop_from_index(ckpt: Path, out: Path, key: str) -> Path:
    out = _sharded_copy(ckpt, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _reshaped(ckpt: Path, out: Path, key: str) -> Path:
    import shutil

    shutil.copytree(ckpt, out)
    tensors = load_file(out / "model.safetensors")
    tensors[key] = tensors[key][:-1].clone()  # one row short
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_an_index_missing_a_tensor_is_refused_naming_it(ckpt, tmp_path):
    bad = _drop_from_index(ckpt, tmp_path / "m", "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: missing from model"):
        build(bad, lora=False, strategy="ddp")


def test_a_reshaped_tensor_is_refused_naming_it(ckpt, tmp_path):
    bad = _reshaped(ckpt, tmp_path / "m", "model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: shape \[31, 32\]"):
        build(bad, lora=False, strategy="ddp")


def _torchrun(ckpt: Path, kinds: str, out: Path, port: int) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
        str(HERE / "_sharded_load_worker.py"), str(ckpt), kinds, str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_two_ranks_read_their_shards_and_equal_the_files(ckpt, tmp_path):
    out = tmp_path / "out"
    done = _torchrun(ckpt, "full,lora", out, 29561)  # both builds in one launch
    assert done.returncode == 0, done.stderr[-3000:]
    for kind in ("full", "lora"):
        full = load_file(out / f"params_{kind}.safetensors")
        _assert_equals_files(full, ckpt)
        # sharded: each rank holds its half of the rows (ceil on rank 0), not the whole tensor
        shards = [json.loads((out / f"shard_{kind}_{r}.json").read_text()) for r in (0, 1)]
        rows = full["model.embed_tokens.weight"].shape[0]
        assert [s["model.embed_tokens.weight"][0] for s in shards] == [-(-rows // 2), rows // 2]
        if kind == "lora":  # the adapters as one process draws them (module order: the worker's)
            ordered = {n: full[n] for n in shards[0]}
            _assert_seeded_adapters(ordered, pretrained_settings(ckpt, True).train.seed)


@pytest.mark.slow
def test_two_ranks_both_raise_on_a_missing_tensor(ckpt, tmp_path):
    bad = _drop_from_index(ckpt, tmp_path / "m", "lm_head.weight")
    done = _torchrun(bad, "full", tmp_path / "out", 29565)  # returns: no rank waits for the other
    errors = [(tmp_path / "out" / f"error_{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1] and "lm_head.weight: missing from model.safetensors.index.json" in errors[0]
    assert pretrained_settings(bad, False).model.pretrained_model_name_or_path in errors[0]
    assert done.returncode == 0, done.stderr[-2000:]
