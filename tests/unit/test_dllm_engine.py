"""`inference/dllm_engine.py` in-process: what a run/export dir serves (the gated evaluation's settings and
sweep point), a request's sampler config (steps kept per token, overrides refused by field, batch keys),
and the round-robin `Scheduler` driving the engine block by block: each answer is the sampler's own
for that prompt decoded alone (`Sampler.generate`, the reference), however the batch was formed."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from _serving import TINY_DLLM_TEXTS as TEXTS
from _serving import tiny_dllm_export
from dllmflow.inference.dllm_engine import DllmEngine, ServedModel, resolve_served, served_from_path
from dllmflow.inference.requests import RequestError
from dllmflow.settings import load_settings

RECORDED = {"steps": 12, "max_new_tokens": 12, "block_size": 4}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_dllm_export(tmp_path_factory.mktemp("dllm_engine") / "export")


@pytest.fixture(scope="module")
def engine(export):
    return DllmEngine(ServedModel(export, "llada", RECORDED, "mdlm"))


def test_a_run_dir_serves_the_setting_it_was_gated_at(export, tmp_path):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "consolidated").symlink_to(export, target_is_directory=True)
    sweep = {"chosen": 1, "points": [{"setting": {"threshold": None}}, {"setting": {"threshold": 0.9}}]}
    protocol = {"sampler": "llada", "sampler_settings": {**RECORDED, "threshold": 0.9}}
    (run / "eval" / "llada.json").write_text(json.dumps({"protocol": protocol, "sweep": sweep}))
    served = served_from_path(run)
    assert served.sampler == "llada" and served.mode == "mdlm"
    assert served.sampler_settings == {**RECORDED, "threshold": 0.9}
    assert served.lineage["setting"] == {"threshold": 0.9}
    assert served_from_path(export).sampler_settings == {}  # an export without a dllm block: the preset
    assert resolve_served(run)[1] == served and resolve_served(export)[1] == served_from_path(export)


def test_a_plain_causal_lm_dir_is_not_a_dllm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_served(tmp_path) == (tmp_path, None)
    assert resolve_served(tmp_path / "missing") == (None, None)


def test_serve_resolves_what_a_run_dir_serves_once(export, tmp_path):
    """`dllmflow serve --model-path RUN` finds the run's export once per start (`runs.find_export` called
    from outside itself), not once per question asked of it (dLLM or not, sampler, weights)."""
    import argparse
    import sys

    from dllmflow import runs
    from dllmflow.inference.serve_cli import add_cli_args, app_from_args

    run = tmp_path / "run"
    run.mkdir()
    (run / "consolidated").symlink_to(export, target_is_directory=True)
    inner = {runs.find_export.__code__, runs.newest_run_export.__code__}
    callers: list[str] = []

    def spy(frame, event, arg):
        if event == "call" and frame.f_code is runs.find_export.__code__ and frame.f_back.f_code not in inner:
            callers.append(frame.f_back.f_code.co_name)

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    sys.setprofile(spy)
    try:
        app, name = app_from_args(parser.parse_args(["--model-path", str(run)]))
    finally:
        sys.setprofile(None)
    assert name == "run" and callers == ["resolve_served"], callers


def test_request_configs(engine):
    req = engine.request([5, 6], {}, None, stream=False, steps_cap=64)
    assert (req.config.steps, req.config.max_new_tokens, req.config.block_size) == (12, 12, 4)
    shorter = engine.request([5, 6], {}, 4, stream=False, steps_cap=64)
    assert (shorter.config.steps, shorter.config.max_new_tokens) == (4, 4)  # 1 step per token, as recorded
    kept = engine.request([5, 6], {"steps": 2}, 4, stream=False, steps_cap=64)
    assert kept.config.steps == 2
    other_seed = engine.request([7], {"seed": 3}, None, stream=False, steps_cap=64)
    assert other_seed.batch_key() == req.batch_key()  # greedy: the seed draws nothing
    sampled = engine.request([7], {"temperature": 0.5}, None, stream=False, steps_cap=64)
    again = engine.request([7], {"temperature": 0.5}, None, stream=False, steps_cap=64)
    assert sampled.batch_key() != again.batch_key()  # a shared generator would tie their draws
    for over, param in [({"thresh": 1}, "dllmflow.thresh"), ({"threshold": 0}, "dllmflow.threshold"),
                        ({"temperature": -1}, "temperature"), ({"sampler": "idlm"}, "dllmflow.sampler"),
                        ({"steps": 65}, "dllmflow.steps")]:  # fmt: skip
        with pytest.raises(RequestError) as e:
            engine.request([5], over, None, stream=False, steps_cap=64)
        assert e.value.param == param, (over, str(e.value))


def test_server_settings_replace_the_recorded_ones_and_are_checked_first(export):
    from dllmflow.errors import UserError
    from dllmflow.inference.serve_cli import parse_sampler_settings

    recorded = {**RECORDED, "threshold": 0.9}
    settings = parse_sampler_settings(["cache=dual", "threshold=none", "steps=6"])
    assert settings == {"cache": "dual", "threshold": None, "steps": 6}
    served = DllmEngine(ServedModel(export, "llada", recorded, "mdlm"), settings=settings)
    assert (served.preset.cache, served.preset.threshold, served.preset.steps) == ("dual", None, 6)
    req = served.request([5, 6], {}, None, stream=False, steps_cap=64)
    assert (req.config.cache, req.config.threshold, req.config.block_size) == ("dual", None, 4)
    assert served.request([5], {"cache": "none"}, None, stream=False, steps_cap=64).config.cache == "none"
    assert parse_sampler_settings(["cache=none"]) == {"cache": "none"}  # a mode, not the preset word
    for items, named in [(["cache=triple"], "cache"), (["thresh=0.9"], "thresh"), (["thresh=none"], "thresh"),
                         (["threshold=2"], "threshold"), (["cache"], "cache")]:  # fmt: skip
        with pytest.raises(UserError, match=f"--sampler-setting.*{named}"):
            DllmEngine(
                ServedModel(export / "missing", "llada", recorded, "mdlm"),
                settings=parse_sampler_settings(items),
            )


def test_scheduled_answers_are_each_prompt_decoded_alone(engine):
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.inference.scheduler import Scheduler

    prompts = [
        engine.encode([{"role": "user", "content": t}], {}) for t in ("Hi", TEXTS[0], "What is 2 + 3?")
    ]
    reqs = [engine.request(p, {}, None, stream=True, steps_cap=64) for p in prompts]
    reqs.append(
        engine.request(prompts[0], {"block_size": 6}, None, stream=True, steps_cap=64)
    )  # another batch

    async def serve() -> list[tuple[list, dict]]:
        scheduler = Scheduler(engine, max_batch_size=8, chunk_tokens=1)
        for r in reqs:
            scheduler.submit(r)
        worker = asyncio.create_task(scheduler.run())
        out = []
        for r in reqs:
            events = []
            while (event := await r.events.get())[0] == "tokens":
                events.append(event[1])
            out.append((events, event[1]))
        worker.cancel()
        assert scheduler.counters["batches"] == 2 and scheduler.counters["max_batch_size_seen"] == 3
        return out

    for req, (blocks, done) in zip(reqs, asyncio.run(serve())):
        sampler = SAMPLERS["llada"](engine.model, engine.tokenizer, req.config)
        alone = sampler.generate([req.prompt_ids])
        assert done["text"] == engine.partial_text(alone.sequences[0])
        assert done["completion_tokens"] == len(alone.sequences[0])
        assert all(alone.sequences[0][: len(b)] == b for b in blocks)  # each streamed block is final
        assert 1 <= done["dllmflow"]["nfe"] <= alone.nfe
        # the row alone computes what it computed in the batch: its positions, and tokens ÷ positions
        assert done["dllmflow"]["positions"] == alone.row_positions[0]
        assert done["dllmflow"]["effective_token_ratio"] == round(
            len(alone.sequences[0]) / alone.row_positions[0], 4
        )


def test_a_short_request_finishes_while_a_long_one_takes_its_turns(engine):
    from dllmflow.inference.scheduler import Scheduler

    prompt = engine.encode([{"role": "user", "content": "Hi"}], {})
    long = engine.request(prompt, {"block_size": 1}, 64, stream=True, steps_cap=64)  # 64 blocks: 64 turns
    short = engine.request(prompt, {"block_size": 4}, 4, stream=False, steps_cap=64)

    async def race() -> tuple[int, int]:
        scheduler = Scheduler(engine, max_batch_size=8, chunk_tokens=1)
        worker = asyncio.create_task(scheduler.run())
        scheduler.submit(long)
        assert (await long.events.get())[0] == "tokens"  # the long one is decoding
        scheduler.submit(short)
        assert (await short.events.get())[0] == "done"
        blocks_done = len(long.tokens)
        long.cancelled = True  # leaves its batch at the next turn
        while scheduler.stats()["active_rows"]:
            await asyncio.sleep(0.01)
        worker.cancel()
        return blocks_done, scheduler.counters["dropped"]

    blocks_done, dropped = asyncio.run(race())
    assert long.finish_reason is None and blocks_done < 16 and dropped == 1


def test_a_streamed_row_gets_its_block_before_its_batch_ends_it(tmp_path):
    """With a threshold the rows of a batch finish a block after different numbers of forwards; a
    streamed row's block is published from inside the turn as soon as it is final (`engine.publish`),
    and every block streamed, early or not, is the row's own final tokens as decoded alone."""
    from dllmflow.data.tokenizer import train_bpe_tokenizer
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.inference.scheduler import Scheduler
    from dllmflow.models.build import build_model

    tok = train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")
    tiny = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = build_model(load_settings(model={"tiny": tiny}), tok)
    with torch.no_grad():  # a fresh head is near uniform over 300 tokens: no threshold would ever pass
        model.get_output_embeddings().weight.mul_(50)  # rows now need 1 to 4 forwards for a block
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    load_settings(model={"tiny": tiny}).write_json(tmp_path / "settings.json")
    engine = DllmEngine(ServedModel(tmp_path, "llada", {**RECORDED, "threshold": 0.7}, "mdlm"))
    texts = ("Hi", TEXTS[0], "What is 2 + 3?", TEXTS[1], "May", "Natalia sold 48")
    reqs = [
        engine.request(
            engine.encode([{"role": "user", "content": t}], {}), {}, None, stream=True, steps_cap=64
        )
        for t in texts
    ]
    early = []

    async def serve() -> list[list[list[int]]]:
        scheduler = Scheduler(engine, max_batch_size=8, chunk_tokens=1)
        engine.publish = lambda req, event: (early.append((req, event[1])), scheduler.publish(req, event))
        worker = asyncio.create_task(scheduler.run())
        for r in reqs:
            scheduler.submit(r)
        streamed = []
        for r in reqs:
            events = []
            while (event := await r.events.get())[0] == "tokens":
                events.append(event[1])
            streamed.append(events)
        worker.cancel()
        assert scheduler.counters["batches"] == 1 and scheduler.counters["early_events"] == len(early)
        return streamed

    streamed = asyncio.run(serve())
    assert early  # some row finished a block before the batch's slowest did
    for req, blocks in zip(reqs, streamed):
        alone = SAMPLERS["llada"](engine.model, engine.tokenizer, req.config).generate([req.prompt_ids])
        assert req.tokens == alone.sequences[0]
        assert all(alone.sequences[0][: len(b)] == b for b in blocks)  # each streamed block is final
    for req, toks in early:
        assert req.tokens[: len(toks)] == toks
