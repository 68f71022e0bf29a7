"""Fixtures of the distributed tests (DDP and FSDP share one prepared corpus per module)."""

import pytest
from support import CPU_CONFIG, tiny

from quillgpt.config import load_config
from quillgpt.data.prepare import prepare


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, shakespeare_path):
    data_dir = tmp_path_factory.mktemp("data") / "char"
    prepare(load_config(CPU_CONFIG, tiny(shakespeare_path, data_dir, "unused")).data, progress=False)
    return data_dir
