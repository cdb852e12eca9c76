"""A toy arithmetic chat set and the recipe that overfits a tiny mdlm model on it in seconds.

Used where a *trained* checkpoint is needed on CPU: the evaluation-signal test (trained beats
untrained) and `bench/sample.py` (sampler speed at equal exact match).

    settings = overfit_settings(tmp_dir, train_steps=300, base_yaml="params/tiny_mdlm.yaml")
    prepare(settings); run_training(settings, settings.run_dir)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_arithmetic_chats(path: str | os.PathLike, n: int = 16) -> Path:
    """`n` short GSM-style user/assistant chats ending in `#### N`, as JSONL."""
    path = Path(path)
    with path.open("w") as f:
        for i in range(n):
            a, b = 3 + 7 * i % 50, 11 + 5 * i % 40
            chat = [{"role": "user", "content": f"Tom has {a} apples and buys {b} more. How many now?"},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}\n#### {a + b}"}]  # fmt: skip
            f.write(json.dumps({"messages": chat}) + "\n")
    return path


def overfit_settings(
    root: str | os.PathLike, train_steps: int, base_yaml: str | os.PathLike, **eval_overrides: Any
):
    """Settings that train `base_yaml`'s tiny model on the 16 toy chats (all in train, seq 64) under
    `root`; `eval_overrides` update the eval section."""
    from dllmflow.settings import load_settings

    root = Path(root)
    data = write_arithmetic_chats(root / "chat.jsonl")
    return load_settings(
        base_yaml,
        run_dir=str(root / "run"),
        dataset={"path_or_dataset_id": str(data), "prepared_dir": str(root / "prepared"), "eval_fraction": 0.0,
                 "seq_length": 64},
        tokenizer={"train_vocab_size": 300},
        train={"max_steps": train_steps, "global_batch_size": 16, "local_batch_size": 16, "lr": 3e-3, "warmup_steps": 10,
               "log_every": 100},
        checkpoint={"every_steps": train_steps},
        eval={"limit": 16, "batch_size": 16, **eval_overrides},
    )  # fmt: skip
