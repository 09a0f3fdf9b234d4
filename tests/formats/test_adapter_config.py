"""``reshard.formats.adapter_config``: PEFT's ``adapter_config.json`` read as a closed world, hostile values named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard.errors import CorruptFileError, ReshardError
from reshard.formats.adapter_config import AdapterFacts, find_adapter_config, read_adapter_config

LORA = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "lora_dropout": 0.05}


def _written(tmp_path: Path, content: object) -> Path:
    path = tmp_path / "adapter_config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_settings_are_read(tmp_path: Path) -> None:
    settings = read_adapter_config(_written(tmp_path, {**LORA, "use_rslora": True, "layers_to_transform": [0]}))
    assert (settings.alpha, settings.r, settings.use_rslora, settings.target_modules) == (16.0, 8, True, ["q_proj"])
    assert settings.scaling(4) == 16 / 2  # rsLoRA: alpha / sqrt(r)
    assert dict(settings.kept) == {"layers_to_transform": [0]}
    facts = AdapterFacts(settings, 8, ["q_proj"], "org/base", "CAUSAL_LM")
    written = json.loads(facts.config_json())
    assert written["lora_alpha"] == 16 and isinstance(written["lora_alpha"], int)
    assert (written["base_model_name_or_path"], written["layers_to_transform"]) == ("org/base", [0])


@pytest.mark.parametrize(
    ("content", "error", "match"),
    [
        ("{not json", CorruptFileError, "cannot read the adapter config"),
        ([1, 2], CorruptFileError, "not a JSON object"),
        ({**LORA, "peft_type": "IA3"}, ReshardError, "peft_type 'IA3' is not LORA"),
        ({**LORA, "r": "8"}, CorruptFileError, "r '8' is not a positive integer"),
        ({**LORA, "r": True}, CorruptFileError, "r True is not a positive integer"),
        ({**LORA, "lora_alpha": -1}, CorruptFileError, "lora_alpha -1 is not a positive number"),
        ({**LORA, "use_dora": "yes"}, CorruptFileError, "use_dora 'yes' is not true or false"),
        ({**LORA, "rank_pattern": {"q_proj": 4}}, ReshardError, r"per-layer ranks \(rank_pattern\)"),
        ({**LORA, "fan_in_fan_out": True}, ReshardError, "Conv1D"),
        ({**LORA, "brand_new": {"x": 1}}, ReshardError, "unknown LoRA field brand_new"),
        ({**LORA, "brand_new": [[[[[[[[[[1]]]]]]]]]]}, ReshardError, r"unknown LoRA field brand_new = \[\[\["),
    ],
)
def test_hostile_values_are_named(tmp_path: Path, content: object, error: type, match: str) -> None:
    path = _written(tmp_path, content)
    with pytest.raises(error, match=match) as err:
        read_adapter_config(path)
    assert str(path) in err.value.one_line() and "\n" not in err.value.one_line()


def test_defaults_of_unknown_fields_pass_and_verl_zero_alpha_is_unknown(tmp_path: Path) -> None:
    settings = read_adapter_config(_written(tmp_path, {**LORA, "brand_new": None, "lora_alpha": 0}))
    assert settings.alpha is None and settings.alpha_zero


def test_where_the_config_is_found(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "actor"
    (ckpt / "lora_adapter").mkdir(parents=True)
    assert find_adapter_config(ckpt, "default") is None
    _written(tmp_path / "run", LORA)
    assert find_adapter_config(ckpt, "default") == tmp_path / "run" / "adapter_config.json"  # beside the folder
    _written(ckpt / "lora_adapter", LORA)
    assert find_adapter_config(ckpt, "default") == ckpt / "lora_adapter" / "adapter_config.json"  # verl's
    (ckpt / "second").mkdir()
    _written(ckpt / "second", LORA)
    assert find_adapter_config(ckpt, "second") == ckpt / "second" / "adapter_config.json"  # PEFT's non-default
    _written(ckpt, LORA)
    assert find_adapter_config(ckpt, None) == ckpt / "adapter_config.json"
