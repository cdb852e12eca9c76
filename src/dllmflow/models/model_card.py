"""The model card (`README.md`, Hugging Face layout) and the `dllm` block of an export's configs.

Every consolidated export carries, next to its weights (written by `Strategy.export_card` at the end
of `Strategy.export`):

    README.md               YAML front matter (library_name, base_model, tags [dllm, diffusion, <mode>],
                            datasets, pipeline_tag, dllm: {mode, default_sampler, data_content_hash})
                            + what it is, how to generate, the default sampler's settings, evaluations
    config.json             "dllm": {"mode", "default_sampler", "mask_token_id", "sampler_settings"}
    generation_config.json  the same block (when the model wrote one and its class takes extra keys)

    write_export_card(out_dir, facts)             # at export (training does not know eval results)
    update_model_card(out_dir, {"llada": result}) # later: the flow's register step adds evaluations
    default_sampler(out_dir)                      # what `generate`/the pyfunc decode with by default

Stdlib + PyYAML only (readers such as the pyfunc call `default_sampler` without torch).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dllmflow.common.files import atomic_write_json, atomic_write_text

README = "README.md"
DLLM_KEY = "dllm"  # the block's key in config.json / generation_config.json / the card's front matter
CONFIG_FILES = ("config.json", "generation_config.json")
EVALS_BEGIN, EVALS_END = "<!-- dllmflow:evaluations -->", "<!-- /dllmflow:evaluations -->"
NOT_EVALUATED = "Not evaluated at export time (the fine-tune flow's register step adds its results here)."
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".gguf", ".safetensors", ".bin")


@dataclass(frozen=True)
class ExportFacts:
    """What a card says about one export (gathered by the strategy from the training settings)."""

    name: str
    mode: str
    default_sampler: str | None  # None: no sampler decodes it alone (a DFlash draft)
    mask_token_id: int | None
    sampler_settings: dict[str, Any] = field(default_factory=dict)
    base_model: str | None = None  # hub id or local dir; None = random init (a tiny model)
    dataset: str | None = None  # dataset.path_or_dataset_id
    data_content_hash: str | None = None  # the prepared data's manifest hash
    target_model: str | None = None  # a DFlash draft's target

    def dllm_block(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "default_sampler": self.default_sampler,
            "mask_token_id": self.mask_token_id,
            "sampler_settings": self.sampler_settings,
        }


# ---- writing -------------------------------------------------------------------------------------


def write_export_card(out_dir: str | os.PathLike, facts: ExportFacts, generation_config: bool = True) -> Path:
    """README.md plus the `dllm` block in config.json (and generation_config.json when present and
    `generation_config`: some families' generation config classes refuse unknown keys)."""
    out_dir = Path(out_dir)
    for name in CONFIG_FILES if generation_config else CONFIG_FILES[:1]:
        path = out_dir / name
        if path.is_file():
            data = json.loads(path.read_text())
            data[DLLM_KEY] = facts.dllm_block()
            atomic_write_json(path, data)
    return atomic_write_text(out_dir / README, render_card(facts))


def render_card(facts: ExportFacts, evaluations: str = NOT_EVALUATED) -> str:
    front: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    if _is_hub_id(facts.target_model or facts.base_model):
        front["base_model"] = facts.target_model or facts.base_model
    front["tags"] = ["dllm", "diffusion", facts.mode, "dllmflow"]
    if _is_hub_id(facts.dataset):
        front["datasets"] = [facts.dataset]
    front[DLLM_KEY] = {
        "mode": facts.mode,
        "default_sampler": facts.default_sampler,
        "data_content_hash": facts.data_content_hash,
    }
    rows = [
        ("mode (`dllm.mode`)", f"`{facts.mode}`"),
        ("base model", f"`{facts.base_model}`" if facts.base_model else "random init (a tiny config)"),
        ("data", f"`{facts.dataset}`" if facts.dataset else "unknown"),
        ("data content hash", f"`{facts.data_content_hash}`" if facts.data_content_hash else "unknown"),
        ("mask token id", str(facts.mask_token_id)),
        ("default sampler", f"`{facts.default_sampler}`" if facts.default_sampler else "none"),
    ]
    if facts.target_model:
        rows.insert(2, ("target model (DFlash)", f"`{facts.target_model}`"))
    parts = [
        "---\n" + yaml.safe_dump(front, sort_keys=False) + "---",
        f"# {facts.name}",
        f"A diffusion language model fine-tuned with dllmflow using "
        f"the `{facts.mode}` objective. It loads with `transformers`; decode it with a dllmflow "
        "sampler (iterative unmasking), not `model.generate`.",
        "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows),
        "## How to generate\n\n" + _how_to_generate(facts),
        f"## Evaluation\n\n{EVALS_BEGIN}\n{evaluations}\n{EVALS_END}",
    ]
    return "\n\n".join(parts) + "\n"


def _how_to_generate(facts: ExportFacts) -> str:
    if facts.default_sampler is None:
        return (
            f"A DFlash draft: it proposes blocks that its target `{facts.target_model}` verifies "
            "(speculative decoding); no sampler decodes it alone. In Python:\n\n"
            "```python\nfrom dllmflow.evaluation.acceptance import load_dflash_pair\n\n"
            'pair = load_dflash_pair("PATH")  # this dir; the target comes from its config\n```'
        )
    sampler = facts.default_sampler
    settings = json.dumps(facts.sampler_settings, indent=2, sort_keys=True)
    return (
        f"Default sampler `{sampler}` (recorded in `config.json` under `dllm`, so `--sampler` may be "
        "left out). Its settings as evaluation runs it (its preset under the recipe's `eval:` section; "
        f"flags such as `--steps` or `--max-new-tokens` override them):\n\n```json\n{settings}\n```\n\n"
        "From a shell (`PATH` is this directory; from the Hub: `hf download REPO --local-dir PATH`):\n\n"
        f'```bash\ndllmflow generate --checkpoint PATH --sampler {sampler} --prompt "What is 2 + 3?"\n```\n\n'
        "In Python:\n\n```python\n"
        "from dllmflow.diffusion.samplers import SAMPLERS\n"
        "from dllmflow.diffusion.samplers.configs import build_sampler_config\n"
        "from dllmflow.inference.generate import decode_response, encode_prompt, load_for_generation\n\n"
        'model, tok, trained = load_for_generation("PATH")\n'
        f'sampler = SAMPLERS["{sampler}"](model, tok, build_sampler_config("{sampler}"), '
        "mask_id=model.config.mask_token_id, training_settings=trained)\n"
        'result = sampler.generate([encode_prompt(tok, "What is 2 + 3?")])\n'
        "print(decode_response(tok, result.sequences[0]))\n```"
    )


def update_model_card(export_dir: str | os.PathLike, evals: dict[str, Any]) -> Path:
    """Replace the card's evaluation section with `evals`: sampler -> an `evaluate --output` result
    (`{"metrics": {...}, "protocol": {...}}`) or a plain metrics dict. Idempotent; a card without the
    section (written by hand) gets it appended."""
    path = Path(export_dir) / README
    text = path.read_text() if path.is_file() else ""
    section = f"{EVALS_BEGIN}\n{render_evaluations(evals)}\n{EVALS_END}"
    if EVALS_BEGIN in text and EVALS_END in text:
        head, _, rest = text.partition(EVALS_BEGIN)
        text = head + section + rest.partition(EVALS_END)[2]
    else:
        text = text.rstrip("\n") + f"\n\n## Evaluation\n\n{section}\n"
    return atomic_write_text(path, text)


def render_evaluations(evals: dict[str, Any]) -> str:
    if not evals:
        return NOT_EVALUATED
    lines = ["| sampler | metric | value |", "|---|---|---|"]
    for sampler, result in evals.items():
        metrics = result.get("metrics", result) if isinstance(result, dict) else {}
        for name, value in metrics.items():
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"| `{sampler}` | {name} | {shown} |")
    return "\n".join(lines)


# ---- reading -------------------------------------------------------------------------------------


# models/causal_prompt.py CAUSAL_BLOCKS_ATTR (it imports torch; a test keeps the two equal).
CAUSAL_BLOCKS_FLAG = "dllm_causal_blocks"


def read_dllm_block(export_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The export's `dllm` block (config.json first, then generation_config.json), or None. An export
    of causal blocks written before they became their own mode says `block_causal` next to the causal
    blocks flag: its mode reads as `causal_blocks`, the mode its recorded settings.json loads as."""
    for name in CONFIG_FILES:
        try:
            config = json.loads((Path(export_dir) / name).read_text())
            block = config.get(DLLM_KEY)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(block, dict):
            if block.get("mode") == "block_causal" and config.get(CAUSAL_BLOCKS_FLAG):
                return {**block, "mode": "causal_blocks"}
            return block
    return None


def default_sampler(export_dir: str | os.PathLike) -> str | None:
    """The sampler an export decodes with by default (its `dllm.default_sampler`), or None when the
    export records none (older exports: callers fall back to the mode's first sampler)."""
    return (read_dllm_block(export_dir) or {}).get("default_sampler")


def _is_hub_id(value: str | None) -> bool:
    """A Hub repo id, not a local path or file (the Hub rejects a card whose base_model is a path)."""
    return bool(
        value
        and _HUB_ID.match(value)
        and not value.endswith(_FILE_SUFFIXES)
        and not value.startswith(".")
        and not Path(value).exists()
    )


__all__ = [
    "ExportFacts",
    "default_sampler",
    "read_dllm_block",
    "render_card",
    "update_model_card",
    "write_export_card",
]
