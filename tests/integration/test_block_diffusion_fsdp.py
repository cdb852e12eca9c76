"""FSDP2 on the tiny DiffusionGemma: 2 CPU ranks (gloo) shard with `model.fsdp_units()` (encoder layer i
and decoder layer i together: they share weights) and run the two-pass self-conditioning forward.
The global loss of the first step must equal a single-process run on the same 4 samples, and the
encoder/decoder weights must still be tied after two optimizer steps.

    pytest -q tests/integration/test_block_diffusion_fsdp.py      # runs torchrun on this file
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [11, 12, 13, 14]


def _setup(world: int):
    from dllmflow.data.collate import DLLMCollator
    from dllmflow.data.gsm8k import load_gsm8k_rows
    from dllmflow.data.tokenizer import encode_chat, train_bpe_tokenizer
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
        launch={"nproc_per_node": world},
        train={"global_batch_size": 4, "local_batch_size": 4 // world},
    )
    strategy = build_strategy(settings)
    torch.manual_seed(0)
    model = strategy.build_model(tok)
    strategy.setup(model, tok, torch.device("cpu"))
    encoded = [dict(zip(("input_ids", "loss_mask"), encode_chat(tok, r["messages"]))) for r in rows]
    encoded = sorted(encoded, key=lambda r: len(r["input_ids"]))[:4]
    return strategy, model, DLLMCollator.from_settings(settings, tok), encoded


def _loss(strategy, model, batch, counts):
    out = strategy.loss(model, batch)
    return sum(out.weight(k) * out.sums[k] / max(counts[k], 1.0) for k in out.sums)


def _worker(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from dllmflow.training.parallel import apply_fsdp2

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy, model, collate, rows = _setup(world)
    apply_fsdp2(model)  # the trainer's path: shards each fsdp_units() group, then the root
    n = len(rows) // world
    batch = collate(rows[rank * n : (rank + 1) * n])
    batch.update(strategy.corrupt(batch, SEEDS[rank * n : (rank + 1) * n]))
    local = strategy.token_counts(batch)
    keys = sorted(local)
    summed = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(summed)
    counts = dict(zip(keys, summed.tolist()))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(2):
        loss = _loss(strategy, model.train(), batch, counts)
        (loss * world).backward()  # FSDP averages gradients over ranks
        opt.step()
        opt.zero_grad()
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item())
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        tied = all(
            torch.equal(v, state["model.encoder.language_model." + k[len("model.decoder.") :]])
            for k, v in state.items()
            if k.startswith("model.decoder.layers.") and k.endswith("weight")
        )
        Path(out_path).write_text(json.dumps({"losses": losses, "tied": tied}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_ranks_match_single_process_and_keep_ties(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29655"]
    proc = subprocess.run([*cmd, __file__, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tied"]

    strategy, model, collate, rows = _setup(1)
    batch = collate(rows)
    batch.update(strategy.corrupt(batch, SEEDS))
    counts = {k: float(v) for k, v in strategy.token_counts(batch).items()}
    expected = _loss(strategy, model.train(), batch, counts).item()
    assert result["losses"][0] == pytest.approx(expected, rel=1e-5)


if __name__ == "__main__":
    _worker(sys.argv[1])
