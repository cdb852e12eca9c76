"""torchrun worker of test_sharded_load.py: build from a pretrained dir at 2 ranks (FSDP2) and write, per
rank, either every parameter's full tensor (rank 0) or the UserError met.

    python -m torch.distributed.run --nproc_per_node 2 tests/integration/_sharded_load_worker.py CKPT full,lora OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _sharded_ckpt import build  # noqa: E402

from dllmflow.errors import UserError  # noqa: E402


def main(ckpt: str, kinds: str, out: str) -> None:
    """`kinds`: "full,lora" builds both in this one launch (full tensors to params_<kind>.safetensors)."""
    from safetensors.torch import save_file

    rank = int(__import__("os").environ["RANK"])
    for kind in kinds.split(","):
        try:
            model, _, _ = build(Path(ckpt), kind == "lora")
        except UserError as e:
            Path(out, f"error_{rank}.txt").write_text(str(e))
            return
        full = {}
        for name, p in model.named_parameters():
            value = p.full_tensor() if hasattr(p, "full_tensor") else p.data  # collective: every rank
            full[name] = value.detach().clone().contiguous()
        if rank == 0:
            save_file(full, str(Path(out, f"params_{kind}.safetensors")))
        local = {n: list(p.to_local().shape) for n, p in model.named_parameters() if hasattr(p, "to_local")}
        Path(out, f"shard_{kind}_{rank}.json").write_text(json.dumps(local))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
