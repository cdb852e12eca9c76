"""`dllmflow config show`: the resolved settings of a recipe and where each value came from.

    dllmflow config show --params params/tiny_mdlm.yaml
    dllmflow config show --params base.yaml more.yaml --set train.lr=1e-4 --format json

YAML (default) prints every field as the run would see it, each leaf followed by `# <origin>`:
`default` (code), the YAML file that set it, `env DLLMFLOW_TRAIN__LR`, or `override` (`--set`). The
output is valid YAML: `--format yaml` without the comments is a complete recipe. JSON prints
`{"settings": {...}, "origins": {"train.lr": "params/x.yaml", ...}}`. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from .loader import load_settings_with_origins, parse_overrides


def render_yaml(values: dict[str, Any], origins: dict[str, str]) -> str:
    """Nested YAML, each leaf `key: value  # origin` (lists and mappings in flow style)."""
    rows: list[tuple[str, str | None]] = []

    def walk(d: dict[str, Any], prefix: str, depth: int) -> None:
        pad = "  " * depth
        for key, value in d.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                rows.append((f"{pad}{key}:", None))
                walk(value, dotted + ".", depth + 1)
            else:
                rows.append((f"{pad}{key}: {_flow(value)}", origins.get(dotted, "default")))

    walk(values, "", 0)
    width = max(len(text) for text, origin in rows if origin is not None)
    return "\n".join(text if origin is None else f"{text:<{width}}  # {origin}" for text, origin in rows)


def _flow(value: Any) -> str:
    """One value as a single line of YAML (PyYAML's own floats: `1.0e-05`, which it reads back)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"))
    return text.removesuffix("\n...\n").strip()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from dllmflow.common.cli_args import HelpFormatter

    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = sub.add_parser(
        "show", help="Print the resolved settings and each value's origin.", formatter_class=HelpFormatter
    )
    show.add_argument(
        "--params", nargs="*", default=[], metavar="YAML", help="recipe(s); later ones override"
    )
    show.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a field, e.g. train.lr=1e-4"
    )
    show.add_argument("--format", choices=["yaml", "json"], default="yaml")


def cli_main(args: argparse.Namespace) -> int:
    settings, origins = load_settings_with_origins(*args.params, **parse_overrides(args.set))
    values = settings.to_dict()
    if args.format == "json":
        print(json.dumps({"settings": values, "origins": origins}, indent=2))
    else:
        print(render_yaml(values, origins))
    return 0
