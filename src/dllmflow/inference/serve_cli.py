"""`dllmflow serve` on the command line, and `local_server`: the same server in a subprocess.

    dllmflow serve --model-path runs/target --port 30000 --served-model-name target
    dllmflow serve --model runs/tiny_addition                # a dLLM run: its gated sampler and settings
    dllmflow serve --model runs/tiny_addition --sampler-setting cache=dual   # ... served with a cache
    dllmflow serve --model models:/dllmflow-tiny-addition@champion   # a registered dLLM (inference/registered.py)
    python -m dllmflow.inference.serve_cli --model-path runs/target          # the same, without the cli

    with local_server("runs/target", served_model_name="target") as url:    # http://127.0.0.1:PORT/v1
        regenerate(cfg, server_url=url)

`local_server` starts `dllmflow serve` in a subprocess, waits for `/health`, yields the base URL and
stops the server on exit (the regeneration pipeline serves its target this way). `serve_process` does
the same for any command that starts a server (tests wrap the app this way).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from dllmflow.common.cli_args import add_flag
from dllmflow.common.net import free_port
from dllmflow.errors import UserError
from dllmflow.inference.dllm_engine import resolve_served
from dllmflow.inference.requests import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGES

log = logging.getLogger("dllmflow.inference.serve")
GRACE_S = 2.0  # what a stopping server gives open requests to finish (SIGTERM ends it within seconds)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "--model",
        "--model-path",
        dest="model_path",
        required=True,
        help="What to serve: a local causal LM dir (config, weights, tokenizer with a chat template), a "
        "dllmflow run or export dir (a dLLM, decoded with its recorded sampler), or a registered model "
        "models:/<name>@<alias> or models:/<name>/<version>.",
    )
    p.add_argument("--host", default="127.0.0.1", help="Bind address (default loopback only).")
    p.add_argument("--port", type=int, default=30000)
    add_flag(
        p, "--served-model-name", default=None, help="The `model` clients must send (default: the dir name)."
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_flag(
        p, "--threads", type=int, default=None,
        help="CPU threads each forward may use (default: $OMP_NUM_THREADS, else every core this process may "
        "use but one, left to reading, tokenising and streaming requests). On a CPU a batched forward "
        "spreads its rows over them; a lone small one barely does.",
    )  # fmt: skip
    add_flag(p, "--max-batch-size", type=int, default=16, help="Most requests generated together.")
    add_flag(
        p,
        "--max-tokens-cap",
        type=int,
        default=1024,
        help="Largest max_tokens a request may ask for (400 above).",
    )
    add_flag(
        p, "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
        help="Largest request body in bytes (413 above; default 1 MiB).",
    )  # fmt: skip
    add_flag(
        p, "--max-messages", type=int, default=DEFAULT_MAX_MESSAGES,
        help=f"Most messages in one chat request (400 above; default {DEFAULT_MAX_MESSAGES}).",
    )  # fmt: skip
    add_flag(
        p, "--request-timeout-s", type=float, default=300.0,
        help="A request unanswered after this long gets HTTP 504 and leaves its batch (default 300).",
    )  # fmt: skip
    add_flag(
        p, "--chunk-tokens", type=int, default=8,
        help="New tokens per batch per scheduling turn: smaller lets short requests past long ones sooner "
        "(causal LMs; a dLLM's turn is one block).",
    )  # fmt: skip
    add_flag(
        p, "--api-key", default=None,
        help="Require this Bearer token on every route but /health (default $DLLMFLOW_SERVE_API_KEY).",
    )  # fmt: skip
    add_flag(
        p, "--sampler-setting", action="append", default=None, metavar="KEY=VALUE",
        help="dLLM: serve with this sampler setting instead of the recorded one (repeat per key), e.g. "
        "cache=dual, threshold=0.9, steps=64; validated like a request's `dllmflow` overrides. Requests "
        "may still override it.",
    )  # fmt: skip
    add_flag(
        p, "--trust-remote-code", action="store_true",
        help="dLLM: run the checkpoint's own Python code (auto_map); only for checkpoints you trust. A "
        "registered version recorded with trust_remote_code is refused without it.",
    )  # fmt: skip
    add_flag(
        p, "--tracking-uri", default=None,
        help="MLflow tracking server of a models:/ URI (default $MLFLOW_TRACKING_URI, else MLflow's).",
    )  # fmt: skip
    add_flag(p, "--log-level", default="INFO")


def parse_sampler_settings(items: Sequence[str] | None) -> dict:
    """`--sampler-setting KEY=VALUE` items -> {key: value}: numbers and booleans as YAML reads them,
    none/null -> None (the sampler's preset) except for `cache`, where "none" is a mode (no cache)."""
    import yaml

    out: dict = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key, text = key.strip().replace("-", "_"), text.strip()
        if not sep or not key or not text:
            raise UserError(f"--sampler-setting {item!r}: write KEY=VALUE, e.g. cache=dual")
        if key == "cache":
            out[key] = text
        elif text.lower() in ("none", "null"):
            out[key] = None
        else:
            try:
                out[key] = yaml.safe_load(text)
            except yaml.YAMLError:
                out[key] = text  # the sampler config names what it cannot take
    return out


def check_served_setting(engine) -> None:
    """Refused at start, once the weights and tokenizer are loaded: a served setting (recorded with the
    model, or `--sampler-setting`) whose `max_new_tokens` leaves no position for a prompt, or whose
    `eos_token_id` is not a token of the tokenizer; every request without overrides would fail or never
    stop."""
    from dllmflow.diffusion.samplers.asked import check_eos
    from dllmflow.diffusion.samplers.configs import SamplerSettingError
    from dllmflow.models.limits import max_positions

    preset, where = engine.preset, "--sampler-setting"

    def source(key: str) -> str:
        return where if key in engine.settings else f"the setting recorded with {engine.served.checkpoint}"

    limit = max_positions(engine.model)
    if limit is not None and preset.max_new_tokens >= limit:
        raise UserError(
            f"max_new_tokens {preset.max_new_tokens} ({source('max_new_tokens')}) leaves no room for a prompt in "
            f"the model's max_position_embeddings ({limit}); serve with {where} max_new_tokens=N, N < {limit}"
        )
    try:
        check_eos(preset, len(engine.tokenizer))
    except SamplerSettingError as e:
        raise UserError(f"{source('eos_token_id')}: {e}") from None


def app_from_args(args: argparse.Namespace):
    """Check the flags, resolve what `--model` names (once), load the engine, build the app: (app, served
    model name). A registered model (`models:/...`, `inference/registered.py`) and a dllmflow run/export
    dir serve a dLLM, any other dir a causal LM."""
    from dllmflow.inference.engine import ChatEngine
    from dllmflow.inference.serve import build_app

    counts = ("max_batch_size", "max_tokens_cap", "chunk_tokens", "max_body_bytes", "max_messages")
    if bad := [f"--{k.replace('_', '-')}" for k in counts if getattr(args, k) < 1]:
        raise UserError(f"{', '.join(bad)} must be >= 1")
    if args.request_timeout_s <= 0:
        raise UserError(f"--request-timeout-s must be > 0 (got {args.request_timeout_s:g})")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1 (got {args.threads})")
    settings = parse_sampler_settings(getattr(args, "sampler_setting", None))  # before any download
    options = dict(
        max_batch_size=args.max_batch_size, max_tokens_cap=args.max_tokens_cap,
        request_timeout_s=args.request_timeout_s,
        api_key=args.api_key or os.environ.get("DLLMFLOW_SERVE_API_KEY") or None,
        max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
    )  # fmt: skip
    trust = bool(getattr(args, "trust_remote_code", False))
    if str(args.model_path).startswith("models:/"):
        from dllmflow.inference.registered import resolve_registered

        tracking_uri = getattr(args, "tracking_uri", None)
        ckpt, served = None, resolve_registered(args.model_path, tracking_uri, trust_remote_code=trust)
    else:  # the one resolution of the dir (its export), whatever it serves
        ckpt, served = resolve_served(args.model_path)
    if served is not None:
        from dllmflow.inference.dllm_engine import DllmEngine
        from dllmflow.inference.dllm_serve import build_dllm_app

        # the caller's flag, never the checkpoint or the registry, decides (docs/security.md)
        served = dataclasses.replace(served, trust_remote_code=trust)
        engine = DllmEngine(served, args.dtype, settings=settings, max_tokens_cap=args.max_tokens_cap)
        check_served_setting(engine)
        name = args.served_model_name or served.lineage.get("name") or Path(args.model_path).resolve().name
        return build_dllm_app(engine, name, **options), name
    if settings:
        raise UserError(f"--sampler-setting: {args.model_path} is a causal LM; only a dLLM has a sampler")
    engine = ChatEngine(ckpt or args.model_path, args.dtype)  # a run dir serves its consolidated export
    name = args.served_model_name or Path(args.model_path).resolve().name
    return build_app(engine, name, chunk_tokens=args.chunk_tokens, **options), name


def cli_main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app, name = app_from_args(args)
    import torch

    # process-wide: the scheduler's decode thread inherits it
    torch.set_num_threads(getattr(args, "threads", None) or default_threads())
    log.info("serving %s as %r on http://%s:%d/v1", args.model_path, name, args.host, args.port)
    # SIGTERM: requests still open after GRACE_S are cancelled, and with them the decoding turn
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
        timeout_graceful_shutdown=GRACE_S,
    )  # fmt: skip
    return 0


def default_threads() -> int:
    """The torch threads a server's forwards use unless `--threads` says: $OMP_NUM_THREADS when set, else
    every CPU this process may use but one. The event loop (reading, tokenising and streaming requests)
    needs a core of its own: with every core in the forwards it waited for them, and a block a batch row
    had finished early went out only once the block's last forward was done (the 1,200-step demo served at
    its gated threshold 0.9 on 2 cores: first block of 16 concurrent clients / a lone one 1.58x with both
    cores in the forwards, 1.38x with one; with no threshold 1.59x and 1.63x)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, len(os.sched_getaffinity(0)) - 1)


# ---- subprocess helpers -------------------------------------------------------------------------


def _wait_healthy(proc: subprocess.Popen, base: str, log_file: Path, what: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = log_file.read_text(errors="replace")[-3000:]
            raise UserError(f"{what} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise UserError(f"{what} did not answer {base}/health within {timeout_s:.0f} s")
        time.sleep(0.2)


@contextlib.contextmanager
def serve_process(
    cmd: Sequence[str], base: str, *, env: dict[str, str] | None = None, what: str = "the server",
    startup_timeout_s: float = 300.0, log_path: str | os.PathLike | None = None,
) -> Iterator[str]:  # fmt: skip
    """Run `cmd` (a server listening at `base`, e.g. `http://127.0.0.1:PORT`) until the block ends; yield
    `base + "/v1"` once `base/health` is 200. Its output goes to `log_path` (default a temp file, removed
    after), whose tail is shown if it exits before answering."""
    own_log = log_path is None
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="dllmflow-serve-", suffix=".log")
        os.close(fd)
    log_file = Path(log_path)
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(proc, base, log_file, what, startup_timeout_s)
        yield f"{base}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if own_log:
            log_file.unlink(missing_ok=True)


def serve_args(model_path: str | os.PathLike, host: str, port: int, **options) -> list[str]:
    """`dllmflow serve` flags for `model_path` on host:port; `options` (snake_case flags) left None keep
    the CLI defaults."""
    argv = ["--model-path", str(model_path), "--host", host, "--port", str(port), "--log-level", "WARNING"]
    for key, value in options.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


@contextlib.contextmanager
def local_server(
    model_path: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str | None = None,
    max_batch_size: int | None = None,
    max_tokens_cap: int | None = None,
    request_timeout_s: float | None = None,
    chunk_tokens: int | None = None,
    sampler_settings: dict | None = None,
    threads: int | None = None,
    api_key: str | None = None,
    startup_timeout_s: float = 300.0,
    log_path: str | os.PathLike | None = None,
) -> Iterator[str]:
    """Run `dllmflow serve` in a subprocess; yield its base URL (`http://host:port/v1`) once `/health` is 200.

    `port=None` picks a free one (give a fixed port when the URL must stay the same across runs, e.g. a
    resumed regeneration, whose manifest records the server URL). Options left `None` keep the CLI
    defaults. `sampler_settings` ({"cache": "dual"}): a dLLM's `--sampler-setting`s; `threads`: torch's CPU
    threads in the server (`--threads`; default: `default_threads()`, from the environment). The server's log goes
    to `log_path` (default: a temp file) and its tail is shown if it fails to start.
    """
    port = port or free_port(host)
    options = dict(
        served_model_name=served_model_name, max_batch_size=max_batch_size, max_tokens_cap=max_tokens_cap,
        request_timeout_s=request_timeout_s, chunk_tokens=chunk_tokens, threads=threads,
    )  # fmt: skip
    cmd = [sys.executable, "-m", "dllmflow.cli", "serve", *serve_args(model_path, host, port, **options)]
    for key, value in (sampler_settings or {}).items():
        cmd += ["--sampler-setting", f"{key}={'none' if value is None else value}"]
    env = {**os.environ, "DLLMFLOW_SERVE_API_KEY": api_key or ""}  # not on the command line (ps)
    what = f"dllmflow serve --model-path {model_path}"
    with serve_process(
        cmd,
        f"http://{host}:{port}",
        env=env,
        what=what,
        startup_timeout_s=startup_timeout_s,
        log_path=log_path,
    ) as url:
        yield url


if __name__ == "__main__":  # `python -m dllmflow.inference.serve_cli ...` = `dllmflow serve ...` (layers)
    from dllmflow.common.cli_args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="dllmflow serve", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    add_cli_args(parser)
    try:
        sys.exit(cli_main(parser.parse_args()))
    except UserError as e:
        print(f"dllmflow serve: error: {e}", file=sys.stderr)
        sys.exit(2)
