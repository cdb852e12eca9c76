"""Fixtures shared by the integration tests: a moto S3 server per test.

def test_x(s3): ...                                   # s3.endpoint, s3.env, s3.keys(), s3.stop()
"""

from __future__ import annotations

import pytest
from _services import moto_s3


@pytest.fixture()
def s3(tmp_path):
    with moto_s3("dllmflow", log=tmp_path / "moto.log") as server:
        yield server
