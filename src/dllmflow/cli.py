"""The `dllmflow` command: prepare | train | rl | generate | evaluate | regenerate | serve | register | plan |
export | config.

    dllmflow prepare --params params/tiny_mdlm.yaml
    dllmflow train   --params params/tiny_mdlm.yaml
    dllmflow rl      --params params/tiny_addition_grpo.yaml --init-from runs/tiny_addition
    dllmflow generate --checkpoint runs/tiny_mdlm/checkpoints --prompt "What is 2+3?" --sampler llada
    dllmflow evaluate --checkpoint runs/tiny_mdlm/checkpoints --limit 8
    dllmflow plan --params params/qwen3_8b_idlm.yaml --world-size 8 --device-memory-gib 141
    dllmflow export --checkpoint runs/tiny_mdlm --push-to-hub me/tiny-mdlm --dry-run
    dllmflow config show --params params/tiny_mdlm.yaml --set train.lr=1e-4
    dllmflow --version

Flags are kebab-case (`--max-new-tokens`); the snake_case spellings of the guide (`--max_new_tokens`)
parse too but stay out of `--help` (`dllmflow.common.cli_args`).

Each subcommand lives in its own module, which exposes `add_cli_args(parser)` and `cli_main(args) -> int`;
this file only dispatches (modules are imported lazily so `dllmflow --help` is fast). Bad input
(`UserError`, including `SettingsError`) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from dllmflow.common.cli_args import HelpFormatter
from dllmflow.errors import UserError

COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("dllmflow.data.prepare", "Tokenise chat data into parquet shards + manifest (DVC stage)."),
    "train": ("dllmflow.training.launch", "Launch training through torchx (torchrun) and wait."),
    "rl": ("dllmflow.workflow.grpo", "GRPO from a supervised model (torchx/torchrun), like train."),
    "generate": ("dllmflow.inference.generate", "Generate text from a checkpoint with a sampler."),
    "evaluate": ("dllmflow.evaluation.accuracy", "GSM8K exact match and speed of a checkpoint."),
    "regenerate": (
        "dllmflow.data.regen_client",
        "Regenerate assistant turns through an OpenAI-compatible server.",
    ),
    "serve": (
        "dllmflow.inference.serve_cli",
        "Serve a dLLM (run dir, export, models:/ URI) or a causal LM behind an OpenAI-compatible API.",
    ),
    "register": ("dllmflow.tracking.register_cli", "Log a finished run to MLflow and register its model."),
    "plan": ("dllmflow.training.planner", "Per-rank training memory of a recipe (no weights, no GPU)."),
    "export": (
        "dllmflow.inference.export",
        "Stage a checkpoint's export with its model card, or push it to the Hugging Face Hub.",
    ),
    "config": ("dllmflow.settings.show", "Show resolved settings and where each value came from."),
}


def package_version() -> str:
    try:
        return importlib.metadata.version("dllmflow")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return "unknown"


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object | None]:
    parser = argparse.ArgumentParser(
        prog="dllmflow", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"dllmflow {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    module = None
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (mod_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name == wanted:  # import only the module that runs
            module = importlib.import_module(mod_name)
            module.add_cli_args(p)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser, module = build_parser(argv)
        args = parser.parse_args(argv)
        if module is None:
            parser.print_help()
            return 2
        return int(module.cli_main(args) or 0)
    except UserError as e:
        print(f"dllmflow {argv[0] if argv else ''}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM of a launch (training.launch.RunStopped)
        print(
            f"dllmflow {argv[0] if argv else ''}: stopped by {e}" if str(e) else "interrupted",
            file=sys.stderr,
        )
        return getattr(e, "exit_code", 130)


if __name__ == "__main__":
    sys.exit(main())
