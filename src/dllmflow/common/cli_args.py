"""Command-line flag conventions: kebab-case flags, their snake_case spellings accepted but not shown.

    from dllmflow.common.cli_args import HelpFormatter, add_flag
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_flag(parser, "--max-new-tokens", type=int)   # also parses --max_new_tokens; dest max_new_tokens

The guide and older scripts spell flags in snake_case (`--max_new_tokens`, `--no_kv_cache`); `--help`
shows only the kebab-case spelling once the parser uses `HelpFormatter`. Stdlib only.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

HIDDEN_ALIASES = "dllmflow_hidden_aliases"  # attribute set on an action: spellings --help leaves out


def snake_alias(flag: str) -> str | None:
    """`--max-new-tokens` -> `--max_new_tokens`; None for a flag with no dash inside its name."""
    if not flag.startswith("--") or "-" not in flag[2:]:
        return None
    return "--" + flag[2:].replace("-", "_")


def add_flag(parser: Any, *flags: str, **kwargs: Any) -> argparse.Action:
    """`parser.add_argument(*flags, **kwargs)` plus the snake_case alias of each kebab-case long flag.
    `dest` stays the one argparse derives from the first flag (`args.max_new_tokens`). `parser` may be
    an argument group."""
    aliases = [a for a in map(snake_alias, flags) if a and a not in flags]
    action = parser.add_argument(*flags, *aliases, **kwargs)
    setattr(action, HIDDEN_ALIASES, tuple(aliases))
    return action


class HelpFormatter(argparse.HelpFormatter):
    """Lists each option under its shown spellings only (the snake_case aliases of `add_flag` stay out)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        hidden = getattr(action, HIDDEN_ALIASES, ())
        if hidden:
            action = copy.copy(action)
            action.option_strings = [s for s in action.option_strings if s not in hidden]
        return super()._format_action_invocation(action)


__all__ = ["HelpFormatter", "add_flag", "snake_alias"]
