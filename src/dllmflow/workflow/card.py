"""The Metaflow card of a finetune run: loss curve, eval table (accuracy and speed per sampler) with a
chart (Vega-Lite, drawn by the card viewer), exact match against tokens/s per setting when the recipe
ran `eval.sweep` (Pareto front and the chosen setting marked), sample generations, lineage. Built from
plain run artifacts, so it can be rendered for any run:

    from dllmflow.workflow.card import build_card_components
    for c in build_card_components(settings, run_dir, evals, data, training, registration):
        current.card["report"].append(c)

`results_table(evals)` is the same evaluation as the plain text the flow prints last, and
`comparison_table(side)` the dLLM beside its AR control (`eval.ar_control`).
"""

from __future__ import annotations

import io
from typing import Any

from dllmflow.runs import read_metrics
from dllmflow.settings import Settings
from dllmflow.settings.pipeline import AR_CONTROL, AR_EVALUATION

EVAL_COLUMNS = ("exact_match_strict", "exact_match_flexible", "tokens_per_s", "nfe", "tokens_per_forward")


def loss_chart(run_dir: str) -> dict[str, Any]:
    """Vega-Lite spec of the training curves (`loss`, and `dllm_loss` when logged) per step. A Metaflow
    `VegaChart`: drawn by the card viewer itself (zoom, hover), and no plotting library is imported in
    the `end` step (matplotlib alone cost it ~1.5 s of its ~2.5 s)."""
    values = [
        {"step": r["step"], "curve": name, "loss": r[name]}
        for r in read_metrics(run_dir)
        if "loss" in r
        for name in ("loss", "dllm_loss")
        if r.get(name) is not None
    ]
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "title": "training loss",
        "data": {"values": values},
        "mark": {"type": "line", "tooltip": True},
        "encoding": {
            "x": {"field": "step", "type": "quantitative"},
            "y": {"field": "loss", "type": "quantitative", "scale": {"zero": False}},
            "color": {"field": "curve", "type": "nominal"},
        },
    }


def eval_chart(evals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Vega-Lite spec: one labelled point per sampler, tokens/s against exact match (flexible)."""
    values = [
        {
            "sampler": name,
            "tokens_per_s": result.get("metrics", {}).get("tokens_per_s", 0.0),
            "exact_match_flexible": result.get("metrics", {}).get("exact_match_flexible", 0.0),
        }
        for name, result in evals.items()
    ]
    encoding = {
        "x": {"field": "tokens_per_s", "type": "quantitative", "title": "tokens / s"},
        "y": {"field": "exact_match_flexible", "type": "quantitative", "title": "exact match (flexible)"},
    }
    return _layered_chart(
        "accuracy vs speed per sampler",
        values,
        encoding,
        [
            {"mark": {"type": "point", "filled": True, "size": 80, "tooltip": True}},
            {"mark": {"type": "text", "align": "left", "dx": 7}, "encoding": {"text": {"field": "sampler"}}},
        ],
    )


def _layered_chart(title: str, values: list[dict], encoding: dict, layers: list[dict]) -> dict[str, Any]:
    """A Vega-Lite spec: one data table, shared encoding, marks layered on it."""
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "title": title,
        "data": {"values": values},
        "encoding": encoding,
        "layer": layers,
    }


def sweep_values(evals: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per sweep point of every sampler that ran `eval.sweep`: its setting, exact match,
    tokens/s (the one the choice compared: `speed_of`), NFE, whether it is on the Pareto front and whether
    it was chosen."""
    from dllmflow.evaluation.sweep import setting_label, speed_of

    values = []
    for name, result in evals.items():
        sweep = result.get("sweep")
        for i, point in enumerate(sweep["points"] if sweep else []):
            m = point["metrics"]
            values.append({
                "sampler": name, "setting": setting_label(point["setting"]),
                "exact_match": m.get(sweep["metric"], 0.0), "tokens_per_s": speed_of(point),
                "nfe": m.get("nfe", 0.0), "pareto": i in sweep["pareto"], "chosen": i == sweep["chosen"],
            })  # fmt: skip
    return values


def sweep_chart(evals: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Vega-Lite spec of the sweep: exact match against tokens/s, one point per setting, coloured by
    sampler, filled on the Pareto front, the chosen setting ringed and labelled. None without a sweep."""
    values = sweep_values(evals)
    if not values:
        return None
    encoding = {
        "x": {"field": "tokens_per_s", "type": "quantitative", "title": "tokens / s"},
        "y": {"field": "exact_match", "type": "quantitative", "title": "exact match"},
        "color": {"field": "sampler", "type": "nominal"},
    }
    return _layered_chart(
        "accuracy vs speed per setting (filled: Pareto front; ringed: chosen)",
        values,
        encoding,
        [
            {
                "mark": {"type": "point", "size": 80, "tooltip": {"content": "data"}},
                "encoding": {
                    "fill": {
                        "condition": {"test": "datum.pareto", "field": "sampler", "type": "nominal"},
                        "value": None,
                    }
                },
            },
            {
                "transform": [{"filter": "datum.chosen"}],
                "mark": {"type": "point", "size": 300, "strokeWidth": 2},
            },
            {
                "transform": [{"filter": "datum.chosen"}],
                "mark": {"type": "text", "align": "left", "dx": 10},
                "encoding": {"text": {"field": "setting"}},
            },
        ],
    )


def eval_rows(evals: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for name, result in evals.items():
        m = result.get("metrics", {})
        # tau: the DFlash acceptance length, as evaluate_dflash reports it
        label = f"{name} (lossy)" if result.get("protocol", {}).get("decoding") == "lossy" else name
        rows.append([label] + [_fmt(m.get(c)) for c in EVAL_COLUMNS] + [_fmt(m.get("tau"))])
    return rows


def before_after_rows(evals: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): per sampler, the AR base model's greedy exact match (`eval.ar_baseline`, the `ar`
    evaluation) beside the model's before training (`eval.untrained_baseline`) and after. No rows when
    neither baseline was measured."""
    ar = evals.get(AR_EVALUATION)
    samplers = {n: r for n, r in evals.items() if n != AR_EVALUATION}
    if ar is None and not any(r.get("baseline") for r in samplers.values()):
        return [], []
    before = next((r["baseline"].get("model") for r in samplers.values() if r.get("baseline")), None)
    headers = ["sampler", *(["exact match AR base (greedy)"] if ar else []),
               f"before: {before or 'not measured'}", "after fine-tuning"]  # fmt: skip
    ar_em = [_fmt(ar.get("metrics", {}).get("exact_match_flexible"))] if ar else []
    rows = [
        [name, *ar_em, _fmt(r.get("baseline", {}).get("metrics", {}).get("exact_match_flexible")),
         _fmt(r.get("metrics", {}).get("exact_match_flexible"))]
        for name, r in samplers.items()
    ]  # fmt: skip
    return headers, rows


def before_after_parts(evals: dict[str, dict[str, Any]], markdown: Any, table: Any) -> list[Any]:
    headers, rows = before_after_rows(evals)
    if not rows:
        return []
    return [markdown("## AR base, before and after fine-tuning (exact match, same examples)"),
            table(rows, headers=headers)]  # fmt: skip


def sample_row(sampler: str, prediction: dict[str, Any]) -> list[str]:
    """[sampler, prompt, generation, reference] of one prediction as `evaluation.accuracy.evaluate`
    writes it (`prompt` = the question, `answer` = the gold number; an eval JSON from before `prompt`
    was recorded shows its row `id`)."""
    p = prediction
    reference = p.get("answer", p.get("answer_number"))
    return [
        sampler,
        _clip(p.get("prompt") or p.get("id") or ""),
        _clip(p.get("prediction", "")),
        "" if reference is None else str(reference),
    ]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def build_card_components(
    settings: Settings,
    run_dir: str,
    evals: dict[str, dict[str, Any]],
    data: dict[str, Any],
    training: dict[str, Any],
    registration: dict[str, Any],
) -> list[Any]:
    from metaflow.cards import Markdown, Table, VegaChart

    parts: list[Any] = [
        Markdown(f"# {settings.name}: `{settings.dllm.mode}` fine-tune"),
        Markdown("## Training loss"),
        VegaChart(loss_chart(run_dir)),
        Markdown("## Evaluation"),
        Table(eval_rows(evals), headers=["sampler", *EVAL_COLUMNS, "tau"]),
    ]
    if evals:
        parts.append(VegaChart(eval_chart(evals)))
    swept = sweep_chart(evals)
    if swept is not None:  # eval.sweep: every setting tried, and the one the model is registered at
        rows = [
            [v["sampler"], v["setting"], _fmt(v["exact_match"]), _fmt(v["tokens_per_s"]), _fmt(v["nfe"]),
             "yes" if v["pareto"] else "", "chosen" if v["chosen"] else ""]
            for v in sweep_values(evals)
        ]  # fmt: skip
        parts += [
            Markdown("## Accuracy and speed per setting (`eval.sweep`)"),
            VegaChart(swept),
            Table(rows, headers=["sampler", "setting", "exact match", "tokens/s", "NFE", "Pareto", ""]),
        ]
    parts += before_after_parts(evals, Markdown, Table)
    side = registration.get("ar_control")
    if side:  # eval.ar_control: the dLLM vs the base fine-tuned AR on the same rows, steps and prompts
        headers, rows = comparison_rows(side)
        parts += [
            Markdown("## dLLM vs AR control (same rows, same steps, same prompts and parser)"),
            Markdown(CONTROL_WHERE),
            Table(rows, headers=headers),
            Markdown(gap_line(side)),
        ]
    samples = [
        sample_row(name, p) for name, result in evals.items() for p in result.get("predictions", [])[:3]
    ]
    if samples:
        parts += [
            Markdown("## Sample generations"),
            Table(samples, headers=["sampler", "prompt", "generation", "reference"]),
        ]
    lineage = [
        ["data content hash", str(data.get("content_hash"))],
        ["DVC stage / rev", f"{data.get('dvc_stage')} / {data.get('dvc_rev')}"],
        ["torchx app", str(training.get("app_handle"))],
        ["MLflow run", str(registration.get("run_id"))],
        ["model version", f"{registration.get('model_name')} v{registration.get('version')}"],
        [
            "gate",
            f"{'promoted' if registration.get('gate_promoted') else 'rejected'}: {registration.get('gate_reason')}",
        ],
        ["git sha", str(registration.get("lineage", {}).get("git_sha"))],
    ]
    parts += [Markdown("## Lineage"), Table(lineage, headers=["what", "value"])]
    return parts


def _clip(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


# ---- the results table the flow prints ---------------------------------------------------------------

# How the untrained AR base's row is named: the "before" of the AR control (`eval.ar_control`).
AR_BASE_LABEL = f"{AR_EVALUATION} (untrained)"


def results_table(evals: dict[str, dict[str, Any]]) -> str:
    """Per sampler: exact match (flexible) of the model before training (same seed, same examples, when
    measured: `eval.untrained_baseline`) and after, tokens/s, NFE per example; DFlash's acceptance shows
    tau; with `eval.sweep`, the setting each sampler was chosen at. With `eval.ar_baseline`, an "EM AR"
    column holds the AR base model's greedy exact match on every row, and its own row, `ar (untrained)`,
    its speed. With `eval.ar_control`, the `ar_control` row is the base fine-tuned AR on the same rows:
    its "EM before" is the untrained base's. Plain text (no colour codes), for a terminal and a CI log."""
    from dllmflow.evaluation.sweep import chosen_setting, setting_label

    swept = any(r.get("sweep") for r in evals.values())  # the setting column: the sweep's chosen point
    ar = evals.get(AR_EVALUATION)  # the AR base model's row: its EM goes beside every sampler's
    ar_em = ar.get("metrics", {}).get("exact_match_flexible") if ar is not None else None
    headers = ["sampler", *(["setting"] if swept else []), "examples", *(["EM AR"] if ar else []),
               "EM before", "EM after", "tok/s", "NFE", "tau"]  # fmt: skip
    rows = []
    for name, result in evals.items():
        m = result.get("metrics", {})
        before = result.get("baseline", {}).get("metrics", {}).get("exact_match_flexible")
        before = ar_em if name == AR_CONTROL else before  # the control's before: the untrained base
        setting = chosen_setting(result)
        is_ar = name == AR_EVALUATION
        rows.append([
            AR_BASE_LABEL if is_ar else name,
            *([setting_label(setting) if setting is not None else "-"] if swept else []),
            _cell(m.get("num_examples")),
            *([_cell(ar_em)] if ar else []),
            _cell(before),
            _cell(None if is_ar else m.get("exact_match_flexible")),
            _cell(m.get("tokens_per_s"), "{:,.0f}"),
            _cell(m.get("nfe"), "{:.1f}"),
            _cell(m.get("tau"), "{:.2f}"),
        ])  # fmt: skip
    return plain_table("Evaluation (held-out examples)", headers, rows)


def plain_table(title: str, headers: list[str], rows: list[list[str]], first_columns: int = 1) -> str:
    """A rich table as plain text, 110 columns wide; the first `first_columns` left-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < first_columns or header == "setting" else "right")
    for row in rows:
        table.add_row(*row)
    console = Console(file=io.StringIO(), width=110, force_terminal=False, color_system=None)
    console.print(table)
    return console.file.getvalue().rstrip()


def _cell(value: Any, fmt: str = "{:.3f}") -> str:
    if value is None:
        return "-"
    return fmt.format(value) if isinstance(value, float) else str(value)


# ---- the dLLM vs AR control (`eval.ar_control`) ----------------------------------------------------

# Where the control ran: the flow's graph has no step of its own for it.
CONTROL_WHERE = (
    "The AR control trained inside the flow's `train` step (after the dLLM; before it where the dLLM "
    "trains on the control), into `<run dir>/ar_control`, and was timed beside the dLLM in `register`."
)


def comparison_rows(side: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the side by side: one row per arm."""
    from dllmflow.evaluation.control import SIDE_BY_SIDE

    headers = ["arm", *SIDE_BY_SIDE.values()]
    arms = ((f"dLLM ({side['sampler']})", side["dllm"]), ("AR control (ar)", side["ar_control"]))
    return headers, [[name, *(_figure(k, figures.get(k)) for k in SIDE_BY_SIDE)] for name, figures in arms]


def comparison_table(side: dict[str, Any]) -> str:
    """The side by side as plain text, with the exact-match gap under it."""
    headers, rows = comparison_rows(side)
    return (
        plain_table("dLLM vs AR control (same rows, same steps, same prompts)", headers, rows)
        + "\n"
        + gap_line(side)
    )


def gap_line(side: dict[str, Any]) -> str:
    """The exact-match gap, and for a model whose answers must be the control's how many are."""
    from dllmflow.evaluation.control import identity_line

    gap = side.get("em_gap")
    line = f"EM gap (dLLM - AR control): {gap:+.3f}" if gap is not None else "EM gap (dLLM - AR control): -"
    identity = identity_line(side)
    return f"{line}\n{identity}" if identity else line


_FORMATS = {"exact_match_flexible": "{:.3f}", "latency_s_b1": "{:.3f}", "tokens_per_s_b16": "{:,.0f}",
            "train_steps": "{:,.0f}", "train_tokens": "{:,.0f}", "train_seconds": "{:,.1f}"}  # fmt: skip


def _figure(key: str, value: Any) -> str:
    return "-" if value is None else _FORMATS[key].format(value)
