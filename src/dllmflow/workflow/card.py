"""The Metaflow card of a finetune run: loss curve, eval table (accuracy and speed per sampler) with a
plot, sample generations, lineage. Built from plain run artifacts, so it can be rendered for any run:

    from dllmflow.workflow.card import build_card_components
    for c in build_card_components(settings, run_dir, evals, data, training, registration):
        current.card["report"].append(c)
"""

from __future__ import annotations

from typing import Any

from dllmflow.runs import read_metrics
from dllmflow.settings import Settings

EVAL_COLUMNS = ("exact_match_strict", "exact_match_flexible", "tokens_per_s", "nfe", "tokens_per_forward")


def loss_figure(run_dir: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps = [r["step"] for r in rows if "loss" in r]
    ax.plot(steps, [r["loss"] for r in rows if "loss" in r], label="loss")
    if any("dllm_loss" in r for r in rows):
        ax.plot(
            steps,
            [r.get("dllm_loss", float("nan")) for r in rows if "loss" in r],
            label="dllm_loss",
            alpha=0.7,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.legend()
    fig.tight_layout()
    return fig


def eval_figure(evals: dict[str, dict[str, Any]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, result in evals.items():
        m = result.get("metrics", {})
        ax.scatter(m.get("tokens_per_s", 0.0), m.get("exact_match_flexible", 0.0), s=60)
        ax.annotate(name, (m.get("tokens_per_s", 0.0), m.get("exact_match_flexible", 0.0)))
    ax.set_xlabel("tokens / s")
    ax.set_ylabel("exact match (flexible)")
    ax.set_title("accuracy vs speed per sampler")
    fig.tight_layout()
    return fig


def eval_rows(evals: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for name, result in evals.items():
        m = result.get("metrics", {})
        # tau: the DFlash acceptance length, as evaluate_dflash reports it
        rows.append([name] + [_fmt(m.get(c)) for c in EVAL_COLUMNS] + [_fmt(m.get("tau"))])
    return rows


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
    from metaflow.cards import Image, Markdown, Table

    parts: list[Any] = [
        Markdown(f"# {settings.name}: `{settings.dllm.mode}` fine-tune"),
        Markdown("## Training loss"),
        Image.from_matplotlib(loss_figure(run_dir)),
        Markdown("## Evaluation"),
        Table(eval_rows(evals), headers=["sampler", *EVAL_COLUMNS, "tau"]),
    ]
    if evals:
        parts.append(Image.from_matplotlib(eval_figure(evals)))
    learned = [
        [
            name,
            _fmt(r["baseline"]["metrics"].get("exact_match_flexible")),
            _fmt(r["metrics"].get("exact_match_flexible")),
        ]
        for name, r in evals.items()
        if r.get("baseline")
    ]
    if learned:  # a tiny model's untrained twin (same seed, same examples): what training added
        parts += [
            Markdown("## Untrained vs trained"),
            Table(learned, headers=["sampler", "exact match untrained (same seed)", "exact match trained"]),
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
