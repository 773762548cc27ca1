from __future__ import annotations

from pathlib import Path

import pytest
from gateway_kit import build_tokenizer

from kvmesh.gateway.tokenizer import PromptTokenizer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(tokenizer_dir)
