"""Error messages name the flags as they are spelled now (kebab-case: `--max-new-tokens`, `--mask-id`)
and suggest only values the flag accepts (never `--max-new-tokens 0`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.cli import COMMANDS, build_parser
from dllmflow.errors import UserError
from dllmflow.models.limits import check_generation_fits
from dllmflow.models.mask_id import resolve_mask_id

SRC = Path(__file__).resolve().parents[2] / "src" / "dllmflow"
SNAKE_FLAG = re.compile(r"--([a-z0-9]+(?:_[a-z0-9]+)+)\b")


def _model(max_positions: int = 64) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=8, intermediate_size=32,
                                        max_position_embeddings=max_positions))  # fmt: skip


def test_limits_name_the_kebab_flags():
    with pytest.raises(UserError, match=r"^--mask-id 100 "):
        check_generation_fits(_model(), 10, 10, 100)
    with pytest.raises(UserError, match=r"^--max-new-tokens 60 .*use --max-new-tokens 54 or less$"):
        check_generation_fits(_model(), 10, 60, 0)
    with pytest.raises(UserError, match="pass --mask-id$"):
        resolve_mask_id(None, tokenizer=None, model=None)


@pytest.mark.parametrize("prompt_length", [64, 80])
def test_no_invalid_value_is_suggested_when_the_prompt_fills_the_positions(prompt_length):
    with pytest.raises(UserError) as info:
        check_generation_fits(_model(max_positions=64), prompt_length, 1, 0)
    assert "shorten the prompt" in str(info.value)
    assert not re.search(r"--max-new-tokens -?0\b|--max-new-tokens -\d", str(info.value))


def _kebab_flags() -> set[str]:
    flags = set()
    for name in COMMANDS:
        parser, _ = build_parser([name])
        sub = next(a for a in parser._actions if a.dest == "command").choices[name]
        flags |= {
            o[2:] for a in sub._actions for o in a.option_strings if o.startswith("--") and "-" in o[2:]
        }
    return flags


def _message_strings(path: Path):
    """String constants of a module outside docstrings and comments (the text a user may be shown)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_message_names_an_old_snake_case_flag():
    renamed = {f.replace("-", "_") for f in _kebab_flags()}
    assert "max_new_tokens" in renamed and "mask_id" in renamed  # the scan sees the real flags
    found = [
        f"{path.relative_to(SRC)}:{line}: --{m.group(1)}"
        for path in sorted(SRC.rglob("*.py"))
        for line, text in _message_strings(path)
        for m in SNAKE_FLAG.finditer(text)
        if m.group(1) in renamed
    ]
    assert found == []
