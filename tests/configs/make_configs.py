"""Write the composite ``config.json`` fixtures of this folder from the installed transformers' config classes.

Each is what ``save_pretrained`` writes for the class's defaults, which its docstring ties to a published
checkpoint (``@auto_docstring(checkpoint=...)``), with the ``architectures`` that checkpoint's config names: the
same nesting and keys as the published file (``text_config`` / ``vision_config``, ``thinker_config`` /
``talker_config`` / ``token2wav_config``), at the published sizes.

    python tests/configs/make_configs.py     # rewrite tests/configs/*.json
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# fixture name -> (config class, the architecture the checkpoint's config.json names, the checkpoint)
FIXTURES = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "Qwen/Qwen3.5-27B"),
    "qwen2_5_omni": ("Qwen2_5OmniConfig", "Qwen2_5OmniForConditionalGeneration", "Qwen/Qwen2.5-Omni-7B"),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", "google/gemma-3-4b-it"),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration", "meta-llama/Llama-4-Scout-17B-16E"),
    "mistral3": (
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen/Qwen2-VL-7B-Instruct",
    ),  # as its docstring names
}


def main() -> None:
    import transformers

    for name, (config_class, architecture, _) in FIXTURES.items():
        config = getattr(transformers, config_class)()
        config.architectures = [architecture]
        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            data = json.loads((Path(tmp) / "config.json").read_text())
        (HERE / f"{name}.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
