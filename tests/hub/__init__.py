"""A local Hugging Face Hub for the tests: a real HTTP server that huggingface_hub's own client talks to.

``server.LocalHub`` serves git-less repos kept under one folder (``store``) over the endpoints huggingface_hub
2.4.0 calls (``routes``: reads, ``writes``: repos/commits/PRs, ``lfs``: LFS batch, uploads and CDN downloads).
``fixture.hub`` (loaded by tests/conftest.py) starts one per test with its own ``HF_HOME``, ``HF_ENDPOINT`` and
``HF_TOKEN``, for in-process calls and subprocesses alike::

    def test_inspect_reads_headers_only(hub, tmp_path):
        tiny_llama(tmp_path / "m")
        sha = hub.publish("acme/tiny", tmp_path / "m")       # a commit on main, server-side
        start = len(hub.requests)
        subprocess.run(["reshard", "inspect", "acme/tiny"], check=True)   # inherits HF_ENDPOINT & co.
        assert hub.sent(start) < 2_000_000                 # body bytes the server sent since ``start``
        assert all(r.range for r in hub.requests[start:] if r.host == "localhost")  # LFS reads were ranges

``hub.requests`` logs each request (method, host, path, Range, status, bytes sent and received); the CDN host is
``localhost``, the API host ``127.0.0.1``. ``hub.fail_next`` injects an error or a cut connection; ``hub.grant``
opens a gated repo to a user; ``publish(..., private=True | gated="manual", hash_lfs=False)`` covers access
rules and sparse multi-GB files (``builders.llama_9b``). Xet is off: uploads of LFS files use the LFS protocol.
"""
