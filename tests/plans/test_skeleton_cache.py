"""The cache of meta builds (``plans/skeleton.py`` ``build_skeleton``, ``plans/skeleton_key.py``,
``io/user_cache.py``): a hit is the build itself, anything the answer depends on misses, a damaged entry is built
again, and a conversion that hits imports no transformers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from fixtures.families import PLAN_NAMES, SPECS
from fixtures.models import tiny_llama

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.io import user_cache
from reshard.plans import skeleton, skeleton_key
from reshard.plans.skeleton import build_skeleton


def raw_config(family: str, **changes) -> dict:
    config_class, arguments, model_class = (SPECS | PLAN_NAMES)[family]
    raw = getattr(transformers, config_class)(**arguments).to_dict()
    return json.loads(json.dumps(raw)) | {"architectures": [model_class]} | changes


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """An empty cache of this test's own."""
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / skeleton.KIND


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """The model types built from here on (a hit builds nothing)."""
    built, real = [], skeleton._build

    def counted(config):
        built.append(config.model_type)
        return real(config)

    monkeypatch.setattr(skeleton, "_build", counted)
    return built


@pytest.mark.parametrize(
    ("family", "changes"),
    [("phi3", {"tie_word_embeddings": True}), ("qwen3_moe", {}), ("qwen2_5_vl", {}), ("gpt_neox", {})],
    ids=["tied", "moe", "composite", "renamed"],
)
def test_a_hit_is_the_fresh_build(cache, builds, family, changes):
    config = ModelConfig(raw_config(family, **changes))
    fresh = build_skeleton(config)
    assert builds == [config.model_type] and len(list(cache.iterdir())) == 1
    assert build_skeleton(config) == fresh and builds == [config.model_type]
    assert skeleton.cached_skeleton(config) == fresh
    if changes:
        assert fresh.tied == {"lm_head.weight"}
    if family == "qwen3_moe":
        assert any(".experts." in name for name in fresh.shapes)
    if family == "qwen2_5_vl":
        assert fresh.sub_models
    # transformers' renamings on load, kept with the build: GPT-NeoX's embed_out loads as lm_head; Qwen2.5-VL's
    # checkpoints name the language model as transformers 4 did
    if family == "gpt_neox":
        assert fresh.loaded_as == {"embed_out.weight": "lm_head.weight"}
    elif family == "qwen2_5_vl":
        down = "layers.0.mlp.down_proj.weight"
        assert fresh.loaded_as[f"model.{down}"] == f"model.language_model.{down}"
    else:
        assert fresh.loaded_as == {}


def test_a_refusal_is_kept_with_the_path_of_the_config_at_hand(cache, builds, tmp_path):
    raw = {"model_type": "no_such_model", "hidden_size": 8}
    for path in (tmp_path / "a.json", tmp_path / "b.json"):
        with pytest.raises(ReshardError, match="does not know model_type 'no_such_model'") as refused:
            build_skeleton(ModelConfig(raw, path))
        assert refused.value.path == str(path)
    assert builds == ["no_such_model"]


def test_what_the_answer_depends_on_changes_the_key(monkeypatch, tmp_path):
    """The config's values and architectures, transformers' modules of the model, the distributions installed."""
    root = tmp_path / "site" / "transformers"
    for module in (
        "__init__.py",
        "models/auto/modeling_auto.py",
        "models/llama/modeling_llama.py",
        "models/gpt2/a.py",
    ):
        (root / module).parent.mkdir(parents=True, exist_ok=True)
        (root / module).write_text("x = 1\n")
    monkeypatch.setattr(skeleton_key, "transformers_root", lambda: root)
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "rope_theta": 1.0}
    key = skeleton_key.skeleton_key(llama)
    assert skeleton_key.skeleton_key(json.loads(json.dumps(llama))) == key
    others = [
        llama | {"hidden_size": 16},
        llama | {"rope_theta": 1},  # 1 and 1.0 are two configs to transformers' type checks
        llama | {"architectures": ["LlamaModel"]},
    ]
    assert key not in [skeleton_key.skeleton_key(raw) for raw in others]
    (root / "models" / "gpt2" / "a.py").write_text("x = 2\n")  # another model's folder: not the answer's
    assert skeleton_key.skeleton_key(llama) == key
    for module in ("models/llama/modeling_llama.py", "models/auto/modeling_auto.py"):
        (root / module).write_text("x = 22\n")  # an editable install changed under one version
        assert skeleton_key.skeleton_key(llama) != key
        key = skeleton_key.skeleton_key(llama)
    (root.parent / "timm-1.0.0.dist-info").mkdir()
    assert skeleton_key.skeleton_key(llama) != key
    assert skeleton_key.skeleton_key(llama | {"id2label": {"0": (1, 2)}}) is None  # not JSON's own: never cached


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"{not json",
        b"\xff\xfe",
        b'{"format": 1, "key": "other", "value": {}}',
        b"[" * 100000,
        "shapes",
        "sub_models",
        "loaded_as",
        "heads",
        "refusal",
        "symlink",
        "foreign",
    ],
    ids=[
        "empty",
        "not-json",
        "not-utf8",
        "another-key",
        "deep",
        "bad-shape",
        "bad-sub-model",
        "bad-loaded-as",
        "bad-heads",
        "bad-refusal",
        "symlink",
        "another-user",
    ],
)
def test_a_damaged_entry_is_built_again_and_replaced(cache, builds, damage, tmp_path):
    config = ModelConfig(raw_config("qwen2_5_vl"))
    fresh = build_skeleton(config)
    (entry,) = cache.iterdir()
    stored = json.loads(entry.read_text())
    if damage in ("symlink", "foreign"):  # a whole, valid entry, but not a file of this user's own
        if damage == "foreign" and os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        (tmp_path / "elsewhere.json").write_text(entry.read_text())
        entry.unlink()
        if damage == "symlink":
            entry.symlink_to(tmp_path / "elsewhere.json")
        else:
            os.rename(tmp_path / "elsewhere.json", entry)
            os.chown(entry, 65534, 65534)
        assert build_skeleton(config) == fresh and len(builds) == 2
        return
    if damage == "shapes":
        stored["value"]["skeleton"]["shapes"]["lm_head.weight"] = ["64", 8]
    elif damage == "sub_models":
        stored["value"]["skeleton"]["sub_models"][0][2] = "yes"
    elif damage == "loaded_as":
        stored["value"]["skeleton"]["loaded_as"] = {"embed_out.weight": 7}
    elif damage == "heads":
        stored["value"]["skeleton"]["heads"] = {"model.layers.0.self_attn": 0}
    elif damage == "refusal":
        stored["value"] = {"refusal": ["x", "yes", None]}
    entry.write_bytes(json.dumps(stored).encode() if isinstance(damage, str) else damage)
    assert build_skeleton(config) == fresh
    assert len(builds) == 2
    assert build_skeleton(config) == fresh and len(builds) == 2  # written anew


def test_no_cache_where_none_can_be_written(monkeypatch, tmp_path, builds):
    (tmp_path / "file").write_text("")
    config = ModelConfig(raw_config("phi3"))
    for chosen in ("", str(tmp_path / "file" / "cache")):  # off; a folder that cannot be made
        monkeypatch.setenv("RESHARD_CACHE_DIR", chosen)
        assert build_skeleton(config) == build_skeleton(config)
    assert len(builds) == 4
    assert user_cache.cache_dir() == tmp_path / "file" / "cache"


def test_entries_past_the_bound_are_pruned_oldest_first(cache, monkeypatch):
    monkeypatch.setattr(user_cache, "MAX_ENTRIES", 3)
    for i in range(5):
        user_cache.save(skeleton.KIND, f"k{i}", i)
        os.utime(cache / f"k{i}.json", ns=(i * 10**9, i * 10**9))
    assert sorted(p.name for p in cache.iterdir()) == ["k2.json", "k3.json", "k4.json"]
    assert [user_cache.load(skeleton.KIND, f"k{i}") for i in range(5)] == [None, None, 2, 3, 4]


IMPORTED = re.compile(r"^import time:.*\|\s*transformers(\.|$)", re.MULTILINE)


def test_a_conversion_that_hits_imports_no_transformers(tmp_path):
    """A real ``reshard convert`` twice over one config: the first imports transformers (in its child) and fills the
    cache, the second judges from it, neither importing transformers nor forking (``-X importtime`` sees every
    import of the process and of any child it forks)."""
    tiny_llama(tmp_path / "src", vocab=64)
    env = os.environ | {"RESHARD_CACHE_DIR": str(tmp_path / "cache")}
    imported = []
    for out in ("cold", "warm"):
        command = [sys.executable, "-X", "importtime", "-m", "reshard", "convert", str(tmp_path / "src"), "--tp", "2"]
        done = subprocess.run([*command, "-o", str(tmp_path / out), "-q"], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        imported.append(bool(IMPORTED.search(done.stderr)))
    assert imported == [True, False]
