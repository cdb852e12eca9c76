"""lm-evaluation-harness adapter (evaluation/harness.py) on a tiny prepared dataset + random checkpoint:
the harness's GSM8K exact match equals `evaluate`'s (end to end, and on hand-written predictions that
score 1 and 0), the Monte-Carlo ELBO equals a direct per-draw computation, `generate_until` stops at
the stop string and honours max_gen_toks, an unknown task is a clear error."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _tiny_eval import tiny_eval_export
from lm_eval.api.instance import Instance

from dllmflow.cli import main
from dllmflow.data.task import gold_answer, gsm8k_extract_flexible, gsm8k_extract_strict
from dllmflow.errors import UserError
from dllmflow.evaluation.accuracy import evaluate
from dllmflow.evaluation.harness import (
    DLLMFlowLM,
    draw_continuation_masks,
    elbo_loglikelihood,
    greedy_matches,
    run_harness,
    truncate_at_stops,
)
from dllmflow.inference.generate import decode_response
from dllmflow.models.attention import forward_bidirectional


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_eval_export(tmp_path_factory.mktemp("harness"))[0]


@pytest.fixture(scope="module")
def lm(ckpt):
    return DLLMFlowLM(str(ckpt), n_mc=6, mc_batch_size=4, steps=2)


# ---- GSM8K exact match: the harness scores like `evaluate` --------------------------------------


def test_harness_em_equals_builtin_end_to_end(ckpt):
    ours = evaluate(ckpt, limit=3, overrides={"steps": 2})
    theirs = run_harness(ckpt, task="gsm8k", limit=3, overrides={"steps": 2})
    assert [p["id"] for p in theirs["predictions"]] == [p["id"] for p in ours["predictions"]]
    # same split, prompts, sampler, seed and batches -> the same texts, extractions and scores
    for key in ("prediction", "answer", "pred_strict", "pred_flexible", "correct_strict", "correct_flexible"):
        assert [p[key] for p in theirs["predictions"]] == [p[key] for p in ours["predictions"]], key
    for key in ("exact_match_strict", "exact_match_flexible", "num_examples"):
        assert theirs["metrics"][key] == ours["metrics"][key]
    assert theirs["protocol"]["sampler_settings"] == ours["protocol"]["sampler_settings"]
    assert (
        theirs["lm_eval"]["dllmflow_gsm8k"]["exact_match,strict-match"]
        == ours["metrics"]["exact_match_strict"]
    )


def test_harness_scores_handwritten_predictions_like_builtin(ckpt, lm, monkeypatch):
    """The yaml's filters + exact_match against `evaluate`'s extractors, on texts that score 1 and 0."""

    def texts(gold):
        return [f"{gold} apples.\n#### {gold}",  # strict 1, flexible 1
                f"#### {gold}\nThen 1000 more",  # strict 1, flexible 0
                "no number here",  # 0, 0
                f"It costs ${int(gold):,}.00 in total"]  # strict 0, flexible 1 ($ and .00 normalised)  # fmt: skip

    def fake_generate(requests, disable_tqdm=False):
        return [texts(r.doc["answer"])[k] for k, r in enumerate(requests)]

    monkeypatch.setattr(lm, "generate_until", fake_generate)
    res = run_harness(ckpt, task="gsm8k", limit=4, lm=lm)
    preds = res["predictions"]
    assert [p["prediction"] for p in preds] == [texts(p["answer"])[k] for k, p in enumerate(preds)]
    builtin_strict = [gsm8k_extract_strict(p["prediction"]) == p["answer"] for p in preds]
    builtin_flexible = [gsm8k_extract_flexible(p["prediction"]) == p["answer"] for p in preds]
    assert builtin_strict == [p["correct_strict"] for p in preds] == [True, True, False, False]
    assert builtin_flexible == [p["correct_flexible"] for p in preds] == [True, False, False, True]
    assert res["metrics"]["exact_match_strict"] == sum(builtin_strict) / 4 == 0.5
    assert res["metrics"]["exact_match_flexible"] == sum(builtin_flexible) / 4 == 0.5
    assert all(p["answer"] == gold_answer(f"#### {p['answer']}") for p in preds)


def test_evaluate_cli_harness_writes_results(ckpt, tmp_path, capsys):
    out = tmp_path / "harness.json"
    code = main(["evaluate", "--checkpoint", str(ckpt), "--harness", "gsm8k", "--limit", "2", "--steps", "2",
                 "--output", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["metrics"]["num_examples"] == 2 and res["protocol"]["task"] == "dllmflow_gsm8k"
    assert "exact_match_strict" in capsys.readouterr().out


def test_unknown_harness_task_lists_the_available_ones(ckpt, capsys):
    assert main(["evaluate", "--checkpoint", str(ckpt), "--harness", "nope"]) == 2
    assert "gsm8k" in capsys.readouterr().err
    with pytest.raises(UserError, match="available: gsm8k"):
        run_harness(ckpt, task="mmlu")


# ---- generate_until -----------------------------------------------------------------------------


def _request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_generate_until_stops_at_the_stop_string(lm):
    prompt = lm.apply_chat_template([{"role": "user", "content": "What is 3 + 3?"}])
    full = lm.generate_until([_request("generate_until", prompt, {"until": [], "max_gen_toks": 8})])[0]
    assert len(full) >= 4
    stop = full[2:4]
    cut = lm.generate_until([_request("generate_until", prompt, {"until": [stop], "max_gen_toks": 8})])[0]
    assert cut == full[: full.find(stop)] and len(cut) < len(full)
    assert truncate_at_stops("a b\n\nQuestion: c", ["Question:", "\n\n"]) == "a b"
    assert truncate_at_stops("abc", ["z", ""]) == "abc"


def test_generate_until_honours_max_gen_toks(lm):
    prompt = lm.apply_chat_template([{"role": "user", "content": "What is 3 + 3?"}])
    text = lm.generate_until([_request("generate_until", prompt, {"until": [], "max_gen_toks": 3})])[0]
    runner = lm._runner_for(3)
    assert runner.config.max_new_tokens == 3 and lm.runner.config.max_new_tokens == 8
    seq = runner.generate([lm.tok_encode(prompt)]).sequences[0]
    assert len(seq) <= 3 and text == decode_response(lm.tokenizer, seq)


# ---- loglikelihood: the Monte-Carlo ELBO --------------------------------------------------------


def direct_elbo(model, context, continuation, mask_id, masks):
    """Written out per draw and per position: (L / l) Σ_masked log p(x_i | noised), averaged."""
    L, draws = len(continuation), []
    for row in masks.tolist():
        x = context + [mask_id if m else t for m, t in zip(row, continuation)]
        logp = torch.log_softmax(forward_bidirectional(model, torch.tensor([x]))[0].double(), dim=-1)
        masked = [logp[len(context) + i, t].item() for i, (m, t) in enumerate(zip(row, continuation)) if m]
        draws.append(sum(masked) * L / len(masked))
    return sum(draws) / len(draws)


def test_masks_draw_l_uniform_positions():
    masks = draw_continuation_masks(5, 400, torch.Generator().manual_seed(0))
    counts = masks.sum(1)
    assert masks.shape == (400, 5) and counts.min() == 1 and counts.max() == 5
    assert set(counts.tolist()) == {1, 2, 3, 4, 5}
    assert torch.equal(masks, draw_continuation_masks(5, 400, torch.Generator().manual_seed(0)))


def test_elbo_equals_direct_computation(lm):
    context, continuation = lm.tok_encode("What is 7 + 7?"), lm.tok_encode(" 7 + 7 = 14.")
    masks = draw_continuation_masks(len(continuation), 5, torch.Generator().manual_seed(3))
    with torch.inference_mode():
        estimate = elbo_loglikelihood(lm._forward, context, continuation, lm.mask_id, masks, batch_size=2)
        expected = direct_elbo(lm.model, context, continuation, lm.mask_id, masks)
    assert estimate < 0 and math.isclose(estimate, expected, rel_tol=1e-5)


def test_loglikelihood_requests_use_the_seeded_masks(lm):
    context, continuation = "What is 7 + 7?", " 7 + 7 = 14."
    (ll, greedy), (again, _) = lm.loglikelihood([_request("loglikelihood", context, continuation)] * 2)
    ctx = lm.tok_encode(context)
    cont = lm.tok_encode(context + continuation)[len(ctx) :]
    masks = draw_continuation_masks(len(cont), lm.n_mc, torch.Generator().manual_seed(lm.seed))
    with torch.inference_mode():
        assert math.isclose(ll, direct_elbo(lm.model, ctx, cont, lm.mask_id, masks), rel_tol=1e-5)
    assert ll == again and isinstance(greedy, bool)
    (rolling,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", continuation)])
    masks = draw_continuation_masks(
        len(lm.tok_encode(continuation)), lm.n_mc, torch.Generator().manual_seed(lm.seed)
    )
    with torch.inference_mode():
        expected = direct_elbo(lm.model, [], lm.tok_encode(continuation), lm.mask_id, masks)
    assert math.isclose(rolling, expected, rel_tol=1e-5)


def test_greedy_is_the_one_step_argmax():
    target, mask_id = [4, 2, 7], 9

    def forward(x, attention_mask):  # logits that put each target token first
        logits = torch.zeros(*x.shape, 10)
        logits[0, 1 + torch.arange(3), torch.tensor(target)] = 1.0
        return logits

    assert greedy_matches(forward, [1], target, mask_id, "cpu")
    assert not greedy_matches(forward, [1], [4, 2, 6], mask_id, "cpu")
