"""The registered pyfunc refuses inputs that are not one prompt string per row, with one line naming
the row (or the column): `[None]` is not the prompt "None", a row holding a list is not its first
string, an empty input or prompt generates nothing silently. Refusals are `InvalidGenerationRequest`
(a UserError; HTTP 400 under `mlflow models serve`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from dllmflow.errors import UserError
from dllmflow.settings import load_settings

TEXTS = ["What is 2 + 3? The answer is 5.", "Natalia sold 48 clips in April. #### 72"]


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    from dllmflow.data.tokenizer import train_bpe_tokenizer
    from dllmflow.models.build import build_model
    from dllmflow.tracking.pyfunc import DllmGenerator

    tmp = tmp_path_factory.mktemp("pyfunc-inputs")
    tok = train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")
    settings = load_settings(
        model={"tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}}
    )
    torch.manual_seed(0)
    build_model(settings, tok).save_pretrained(tmp / "ckpt")
    tok.save_pretrained(tmp / "ckpt")
    settings.write_json(tmp / "ckpt" / "settings.json")
    gen = tmp / "generation.json"
    settings_used = {"steps": 2, "max_new_tokens": 2, "block_size": 2}
    gen.write_text(json.dumps({"sampler": "llada", "sampler_settings": settings_used, "mode": "mdlm"}))
    model = DllmGenerator()
    model.load_context(SimpleNamespace(artifacts={"checkpoint": str(tmp / "ckpt"), "generation": str(gen)}))
    return model


BAD = {
    "None": ([None], r"row 0: missing \(None/NaN\), not a prompt string"),
    "None after a prompt": (["What is 2 + 3?", None], r"row 1: missing"),
    "a number": ([3], r"row 0: int, not a prompt string"),
    "nested list": ([["What is 2 + 3?", "and 4 + 4?"]], r"row 0: list, not a prompt string"),
    "empty list": ([], r"no prompts"),
    "empty prompt": (["What?", "  "], r"row 1: an empty prompt"),
    "empty string": ("", r"row 0: an empty prompt"),
    "array of arrays": (np.array([["a", "b"]]), r"row 0: .*not a prompt string"),
    "dataframe, two columns": (pd.DataFrame({0: ["What is 2 + 3?"], 1: ["and 4 + 4?"]}),
                               r"unexpected column.*1.*one column of prompts"),
    "dataframe, unexpected column": (pd.DataFrame({"prompt": ["What?"], "temperature": [0.5]}),
                                     r"unexpected column.*'temperature'"),
    "dataframe, wrong name": (pd.DataFrame({"question": ["What?"]}), r"unexpected column.*'question'"),
    "dataframe, None": (pd.DataFrame({"prompt": ["What?", None]}), r"row 1: missing"),
    "dataframe, empty": (pd.DataFrame({"prompt": []}), r"no prompts"),
    "a dict": ({"prompt": "What?"}, r"dict"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_are_refused_naming_the_row(generator, case):
    from dllmflow.tracking.pyfunc import InvalidGenerationRequest

    model_input, message = BAD[case]
    with pytest.raises(InvalidGenerationRequest, match=message) as info:
        generator.predict(None, model_input)
    assert isinstance(info.value, UserError) and "\n" not in str(info.value.message)


def test_good_inputs_still_generate(generator):
    want = generator.predict(None, ["What is 2 + 3?", "Natalia sold"])
    assert len(want) == 2 and all(isinstance(t, str) for t in want)
    assert generator.predict(None, pd.DataFrame({"prompt": ["What is 2 + 3?", "Natalia sold"]})) == want
    assert generator.predict(None, pd.DataFrame({0: ["What is 2 + 3?", "Natalia sold"]})) == want
    assert generator.predict(None, np.array(["What is 2 + 3?", "Natalia sold"])) == want
    assert generator.predict(None, "What is 2 + 3?") == want[:1]


@pytest.mark.parametrize(
    "params, field",
    [({"steps": 1000}, "steps"), ({"steps": "3"}, "steps"), ({"temperature": float("inf")}, "temperature")],
)
def test_bad_params_are_refused_before_decoding(generator, params, field):
    """The pyfunc's params go through the server's check (`diffusion.samplers.asked`): `steps` past the
    generation length (10^9 steps tried to allocate 8 GB), a string for a number, a non-finite float."""
    from dllmflow.tracking.pyfunc import InvalidGenerationRequest

    with pytest.raises(InvalidGenerationRequest, match=f"^{field}: "):
        generator.predict(None, ["What is 2 + 3?"], params=params)
