"""Resuming on prepared data of another vocabulary (the prepared dir rebuilt with another tokenizer) is
the documented data refusal (training/data.py `check_resume`: "cannot resume on the next sample ...
content_hash ..."), checked before any weight is loaded: not the rank's weight-loading traceback of an
embedding of the other size."""

from __future__ import annotations

import pytest
from _tiny_run import DATA, RECIPE, tiny_run_settings

from dllmflow.errors import UserError
from dllmflow.settings import load_settings

pytestmark = pytest.mark.slow


def test_resuming_on_data_of_another_vocabulary_is_the_data_refusal(tmp_path):
    from dllmflow.data.prepare import prepare
    from dllmflow.data.prepared_dir import read_manifest
    from dllmflow.training.trainer import run_training

    prep = tmp_path / "prep"
    settings = tiny_run_settings(prep, max_steps=2)
    first = prepare(settings)
    run_training(settings, tmp_path / "run")
    other = load_settings(
        RECIPE, dataset={**DATA, "prepared_dir": str(prep)}, tokenizer={"train_vocab_size": 1000}
    )
    prepare(other, force=True)  # the same dir, another tokenizer: another vocabulary
    assert read_manifest(prep)["tokenizer"]["vocab_size"] != first["tokenizer"]["vocab_size"]
    with pytest.raises(UserError) as err:
        run_training(tiny_run_settings(prep, max_steps=4), tmp_path / "run", resume=True)
    msg = str(err.value)
    assert msg.startswith("cannot resume on the next sample") and "content_hash" in msg, msg
