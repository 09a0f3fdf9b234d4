"""The ``hub`` fixture: a fresh local Hub per test, and a client environment pointed at it.

huggingface_hub reads ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_OFFLINE``... once, at import. So the fixture sets
the environment (inherited by subprocesses: the ``hf`` CLI, reshard's CLI, offline runs) *and* patches the
constants the running process already holds, including the endpoint of the module-level ``HfApi`` behind
``huggingface_hub.model_info`` & co. Code under test must build its ``HfApi`` at call time to see the local Hub.

Tokens: ``hub.token`` (user ``tester``, member of org ``acme``, may write; also in ``HF_TOKEN``),
``hub.read_token`` (user ``reader`` of ``acme``, read-only) and ``hub.other_token`` (user ``stranger``, no org).
Xet is off (``HF_HUB_DISABLE_XET=1``): the local Hub serves LFS, not Xet storage.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import LocalHub
from .wire import User

TOKEN, READ_TOKEN, OTHER_TOKEN = "hf_local_tester", "hf_local_reader", "hf_local_stranger"


@pytest.fixture
def hub(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    """A running ``LocalHub``; fails the test if the server hit a bug or the client called an endpoint it lacks."""
    from huggingface_hub import constants, hf_api
    from huggingface_hub.utils import _cache_manager, close_session

    home = tmp_path_factory.mktemp("hf_home")
    tokens = {
        TOKEN: User("tester", orgs=("acme",)),
        READ_TOKEN: User("reader", orgs=("acme",), write=False),
        OTHER_TOKEN: User("stranger"),
    }
    server = LocalHub(tmp_path_factory.mktemp("hub_repos"), tokens)
    server.token, server.read_token, server.other_token, server.home = TOKEN, READ_TOKEN, OTHER_TOKEN, home
    for name in (
        "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE",
        "HF_XET_CACHE", "HF_TOKEN_PATH", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_CO_STAGING",
    ):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    environment = {
        "HF_ENDPOINT": server.endpoint,
        "HF_HOME": str(home),
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_XET": "1",
    }
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    constants_now = {
        "ENDPOINT": server.endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": server.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HUGGINGFACE_HUB_CACHE": str(home / "hub"),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "CHECK_FOR_UPDATE_DONE_PATH": str(home / ".check_for_update_done"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_UPDATE_CHECK": True,
        "HF_HUB_DISABLE_XET": True,
    }
    for name, value in constants_now.items():
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setattr(_cache_manager, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf_api.api, "endpoint", server.endpoint)
    close_session()  # no pooled connection to another test's server
    with server:
        yield server
        close_session()
    assert not server.errors, "the local Hub failed:\n" + "\n".join(server.errors)
    assert not server.unhandled, f"the client called endpoints the local Hub does not serve: {server.unhandled}"
