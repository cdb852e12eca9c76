"""The HTTP side of `dllmflow serve` for a dLLM: OpenAI chat and text completions over a `DllmEngine`,
streamed block by block. Routes, request path, API key, body/message/JSON caps and timeouts are the causal
server's (`inference/serve.py`, whose `ChatServer` this extends); decoding is `inference/dllm_engine.py`.

    dllmflow serve --model models:/dllmflow-tiny-addition@champion --port 30000
    curl -s localhost:30000/v1/completions -d '{"model": "dllmflow-tiny-addition", "prompt": "What is 2 + 3?"}'

    app = build_dllm_app(DllmEngine(served), "tiny", max_tokens_cap=256)   # a Starlette app

Endpoints: `POST /v1/chat/completions` and `POST /v1/completions` (`"stream": true`: server-sent events,
one per committed block as it is committed, ending in `data: [DONE]`), `GET /v1/models` (the served
name plus its lineage under `dllmflow`: registered name, version, alias, run id, sampler, the settings
it decodes with, the sweep setting it was gated at, and what `--sampler-setting` changed from it),
`GET /health`, `GET /stats`. `usage` carries `prompt_tokens`, `completion_tokens`, `total_tokens` and
`dllmflow: {nfe, tokens_per_forward, positions, effective_token_ratio, sampler}` (forwards the
request's row took part in, the positions they computed for it, completion tokens ÷ positions). Per-request
sampler overrides go under the `dllmflow` key (`inference/requests.py`'s `DllmChatBody`), e.g.
`{"dllmflow": {"threshold": 0.9, "cache": "dual"}}`; with the openai client:
`extra_body={"dllmflow": {...}}`.
"""

from __future__ import annotations

from typing import Any

from dllmflow.inference.dllm_engine import DllmEngine, DllmRequest
from dllmflow.inference.requests import DllmChatBody, DllmCompletionBody
from dllmflow.inference.serve import ChatServer, build_app


class DllmServer(ChatServer):
    """`ChatServer`'s routes and request path over a dLLM engine: the bodies take the vendor key, a
    request decodes with the sampler, and the model card tells the lineage."""

    engine: DllmEngine
    SCHEMAS = {True: DllmChatBody, False: DllmCompletionBody}

    def __init__(self, engine: DllmEngine, *args):
        super().__init__(engine, *args)
        engine.publish = self.scheduler.publish  # a row's block streams as soon as it is final, mid-turn

    def card(self) -> dict[str, Any]:
        served = self.engine.served
        return {
            **super().card(),
            "dllmflow": {
                **served.lineage,
                "mode": served.mode,
                "sampler": self.engine.sampler,
                "sampler_settings": self.engine.preset.model_dump(),
                # what `--sampler-setting` changed from the recorded (gated) setting, if anything
                **({"server_settings": self.engine.settings} if self.engine.settings else {}),
            },
        }

    def build_request(self, body: Any, prompt_ids: list[int]) -> DllmRequest:
        """The sampler's request: recorded settings, the server's, then the body's overrides; `max_tokens`
        None decodes the recorded `max_new_tokens`."""
        return self.engine.request(
            prompt_ids, body.sampler_overrides(), body.max_tokens, stream=body.stream,
            steps_cap=self.limits.max_tokens_cap,
        )  # fmt: skip


def build_dllm_app(engine: DllmEngine, served_model_name: str, **options):
    """`serve.build_app` for a dLLM; `options` as its (but `chunk_tokens`: a turn is one block of one
    batch)."""
    return build_app(engine, served_model_name, server_cls=DllmServer, chunk_tokens=1, **options)
