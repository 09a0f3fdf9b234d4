"""The built-model family check beside a conversion (``plans/built_family.py`` ``FamilyCheck``): the same answer in
a forked child, on a thread and from the cache of meta builds, and a child that dies without answering is not taken
for a pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fixtures.models import tiny_llama

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.plans import built_family, skeleton

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
NAMES = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(f"model.layers.0.{p}.weight" for p in ("input_layernorm", "post_attention_layernorm")),
    *(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
]
QWEN2_CLASS = ["Qwen2ForCausalLM"]
QWEN2 = {**LLAMA, "model_type": "qwen2", "architectures": QWEN2_CLASS}  # q/k/v biases Llama lacks


@pytest.fixture
def cold(monkeypatch, tmp_path):
    """An empty cache of meta builds: the check has to build."""
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(params=["fork", "thread", "cached"])
def way(request, monkeypatch, tmp_path):
    """The check in a child, on a thread, or judged at once from a cache that a first build filled."""
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(built_family, "_can_fork", lambda: request.param == "fork")
    if request.param == "cached":
        for config in (LLAMA, QWEN2):
            skeleton.build_skeleton(ModelConfig(config))
        monkeypatch.setattr(skeleton, "_build", lambda config: pytest.fail("built again"))
    return request.param


def test_the_own_family_passes(way):
    check = built_family.start(ModelConfig(LLAMA), NAMES)
    assert check is not None
    assert (check._child is None and check._thread is None) == (way == "cached")
    check.result()


def test_another_family_is_refused_with_the_same_line(way):
    check = built_family.start(ModelConfig(QWEN2), NAMES)
    with pytest.raises(ReshardError) as refused:
        check.result()
    assert "transformers builds Qwen2ForCausalLM" in str(refused.value)
    assert "from_pretrained would initialise them at random" in str(refused.value)


def test_a_child_that_dies_is_not_a_pass(monkeypatch, cold):
    monkeypatch.setattr(built_family, "_can_fork", lambda: True)
    parent = os.getpid()
    real = built_family.check_built_family

    def dies_in_the_child(config, names):
        if os.getpid() != parent:
            os._exit(3)
        real(config, names)

    monkeypatch.setattr(built_family, "check_built_family", dies_in_the_child)
    with pytest.raises(ReshardError, match="transformers builds Qwen2ForCausalLM"):
        built_family.start(ModelConfig(QWEN2), NAMES).result()


def test_a_check_nobody_waits_for_leaves_no_child(monkeypatch, cold):
    monkeypatch.setattr(built_family, "_can_fork", lambda: True)
    check = built_family.start(ModelConfig(LLAMA), NAMES)
    pid = check._child[0]
    del check  # a run that failed before hearing it
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_a_workers_run_hears_worker_0s_refusal_in_one_line(tmp_path):
    """Only worker 0 builds the model; its refusal reaches every worker, and nothing is published."""
    source = tmp_path / "src"
    tiny_llama(source, vocab=64)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"model_type": "qwen2", "architectures": QWEN2_CLASS}))
    out = tmp_path / "out"
    args = ["convert", str(source), "--tp", "2", "-o", str(out), "--workers", "2", "-q"]
    done = subprocess.run([sys.executable, "-m", "reshard", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: worker 0: ") and "Qwen2ForCausalLM" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


STAGING_SPY = """
import os
from reshard.engine.run import conversion as run
real = run.staged
def staged(*args, **kwargs):
    with open(os.environ["STAGING_LOG"], "a") as log:
        log.write(os.environ.get("RANK", "-") + "\\n")
    return real(*args, **kwargs)
run.staged = staged
"""


def test_a_workers_run_hears_a_cached_refusal_before_any_worker_stages(tmp_path):
    """Once the cache of meta builds knows the config's family refuses the tensors, every worker stops at one
    gather before staging an output or moving a byte (before: each moved its share first, and heard it at the end)."""
    source = tmp_path / "src"
    tiny_llama(source, vocab=64)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"model_type": "qwen2", "architectures": QWEN2_CLASS}))
    spy, log = tmp_path / "spy", tmp_path / "staged.log"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(STAGING_SPY)
    env = {**os.environ, "RESHARD_CACHE_DIR": str(tmp_path / "cache"), "STAGING_LOG": str(log)}
    env["PYTHONPATH"] = os.pathsep.join([str(spy), *filter(None, [env.get("PYTHONPATH")])])
    lines = []
    for workers in ("1", "2"):  # the first run builds (and caches) the model, the second finds the answer cached
        out = tmp_path / f"out{workers}"
        args = ["convert", str(source), "--tp", "2", "-o", str(out), "--workers", workers, "-q"]
        done = subprocess.run(
            [sys.executable, "-m", "reshard", *args], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 2, done.stderr
        lines.append(done.stderr.strip().splitlines())
        if workers == "1":
            assert log.read_text().split() == ["-"]  # built beside the conversion: heard at its end
            log.unlink()
    assert len(lines[1]) == 1 and lines[1][0].startswith("Error: worker 0: ") and "Qwen2ForCausalLM" in lines[1][0]
    assert not log.exists()  # no worker staged anything
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "spy", "src"]


SPY = """
import sys
from reshard.plans import built_family
assert "torch" not in sys.modules  # the command imports it on its background thread
real, forks = built_family._fork_check, []
built_family._fork_check = lambda *args: forks.append(1) or real(*args)
from reshard.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as end:
    print("forks", len(forks), "exit", end.code)
"""


def test_a_cold_conversion_forks_the_check_after_torch_is_imported(tmp_path, cold):
    """A real command imports torch on a thread while it plans: the check waits for that import to end, then forks
    (on a thread beside the import, it held the interpreter lock against it and against the bytes)."""
    source = tmp_path / "src"
    tiny_llama(source, vocab=64)
    args = ["convert", str(source), "--tp", "2", "-o", str(tmp_path / "out"), "-q"]
    env = {**os.environ, "RESHARD_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", SPY, *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.stdout.split() == ["forks", "1", "exit", "0"], done.stderr
