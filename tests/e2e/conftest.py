"""E2E fixtures: one `pagoda serve` subprocess with a tiny model (session scope) serves
most tests; test_server_limits.py starts its own with an API key and a tiny queue."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_utils import (
    MAX_BODY_BYTES,
    MAX_LOGPROBS,
    MAX_MODEL_LEN,
    Server,
    start_server,
)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model: Callable[..., Path]) -> Path:
    # NOTE: long enough that a request can outlive a slow client on a busy machine.
    return tiny_model("LlamaForCausalLM", max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: 16 sequences at a time, small body and logprobs limits."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(tiny_llama, log, "--max-num-seqs", "16",
                       "--max-logprobs", str(MAX_LOGPROBS),
                       "--max-request-body-bytes", str(MAX_BODY_BYTES))
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c
