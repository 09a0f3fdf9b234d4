"""A local Hugging Face Hub for the tests: a real HTTP server that huggingface_hub's own client talks to.

``server.LocalHub`` serves git-less repos kept under one folder (``store``), over the endpoints huggingface_hub
2.4.0 calls (``routes``, ``lfs``); ``fixture.hub`` starts one per test with its own ``HF_HOME`` and token.
"""
