"""FSDP2 on the tiny DiffusionGemma: 2 CPU ranks (gloo) shard with `model.fsdp_units()` (encoder layer i
and decoder layer i together: they share weights) and run the two-pass self-conditioning forward
through the trainer's own `train_step`. Three optimizer steps on 2 ranks (1 micro-batch of 2 each) give
the same global losses as one process accumulating the same 2 micro-batches, and the encoder/decoder
weights are still tied at the end.

    pytest -q tests/integration/test_block_diffusion_fsdp.py      # runs torchrun on this file
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _setup(world: int):
    from dllmflow.data.collate import DLLMCollator
    from dllmflow.data.gsm8k import load_gsm8k_rows
    from dllmflow.data.tokenizer import encode_chat, train_bpe_tokenizer
    from dllmflow.diffusion.modes import build_mode_model
    from dllmflow.diffusion.strategies import build_strategy
    from dllmflow.settings import load_settings

    rows = load_gsm8k_rows()[:32]
    tok = train_bpe_tokenizer(
        [m["content"] for r in rows for m in r["messages"]], 512, "<mask>", "<pad>", "<eos>"
    )
    settings = load_settings(
        ROOT / "params" / "tiny_block_diffusion.yaml",
        model={"canvas_length": 16},
        dataset={"seq_length": 192},
        dllm={"vocab_size": len(tok), "block_size": 16, "pad_block_size": 16, "self_conditioning_p": 1.0},
        distributed={"strategy": "fsdp2", "backend": "gloo"},
        launch={"nproc_per_node": world},
        train={"global_batch_size": 4, "local_batch_size": 2, "lr": 1e-2, "lr_schedule": "constant"},
    )
    strategy = build_strategy(settings)
    torch.manual_seed(0)
    model = build_mode_model(settings, tok)
    strategy.setup(model, tok, torch.device("cpu"))
    encoded = [dict(zip(("input_ids", "loss_mask"), encode_chat(tok, r["messages"]))) for r in rows]
    encoded = sorted(encoded, key=lambda r: len(r["input_ids"]))[:4]
    return settings, strategy, model, DLLMCollator.from_settings(settings, tok), encoded


def _train(settings, strategy, model, collate, rows, info) -> list[float]:
    """`STEPS` optimizer steps of the real trainer step; -> the global loss of each step."""
    from dllmflow.training.data import GlobalBatches
    from dllmflow.training.trainer import build_optimizer, train_step

    t = settings.train
    batches = GlobalBatches(
        rows, collate, t.global_batch_size, t.local_batch_size, info.rank, info.world_size, t.seed
    )
    optimizer = build_optimizer(model, settings)
    losses = []
    for step in range(STEPS):
        record = train_step(
            model.train(), strategy, batches, step, settings, info, torch.autocast("cpu", enabled=False)
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(record["loss"])
    return losses


def _worker(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from dllmflow.training.distributed import init_distributed
    from dllmflow.training.parallelize import apply_fsdp

    world = int(os.environ["WORLD_SIZE"])
    settings, strategy, model, collate, rows = _setup(world)
    info = init_distributed(settings)
    model = apply_fsdp(model)  # the trainer's FSDP2 transform: fsdp_units() groups, then the root
    losses = _train(settings, strategy, model, collate, rows, info)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.rank == 0:
        tied = [
            torch.equal(v, state["model.encoder.language_model." + k[len("model.decoder.") :]])
            for k, v in state.items()
            if k.startswith("model.decoder.layers.") and k.endswith("weight")
        ]
        Path(out_path).write_text(json.dumps({"losses": losses, "tied": tied}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fsdp2_two_ranks_match_single_process_and_keep_ties(tmp_path):
    from dllmflow.training.distributed import DistInfo

    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(_free_port()), __file__, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tied"] and all(result["tied"])

    settings, strategy, model, collate, rows = _setup(1)
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)
    expected = _train(settings, strategy, model, collate, rows, info)
    assert expected[-1] != expected[0]  # the optimizer steps changed the model
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    _worker(sys.argv[1])
