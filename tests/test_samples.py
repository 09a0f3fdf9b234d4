"""The committed samples are what their generators write: regenerated, every file is byte-identical.

``sample_ckpts/make_samples.py`` and ``make_megatron_sample.py`` build the samples with ``tests/fixtures`` (the
SAT and tiny-llama-tp2 samples are then split by ``reshard convert`` on purpose); a change to a builder that
changed a sample's bytes would show here before it reached the committed files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures import SAMPLES, load_script, snapshot

GENERATED = {
    "make_samples.py": ["tiny-cogagent-sat-tp8", "tiny-llama-65535-tp2", "tiny-llama-tp2"],
    "make_megatron_sample.py": ["tiny-megatron-tp8"],
}


def test_every_sample_has_a_generator() -> None:
    samples = sorted(p.name for p in SAMPLES.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    assert samples == sorted(name for names in GENERATED.values() for name in names)


@pytest.mark.parametrize("script", sorted(GENERATED))
def test_a_generator_rewrites_its_samples_byte_for_byte(tmp_path: Path, script: str) -> None:
    load_script(SAMPLES / script).main(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == GENERATED[script]
    for name in GENERATED[script]:
        committed, regenerated = snapshot(SAMPLES / name), snapshot(tmp_path / name)
        assert sorted(regenerated) == sorted(committed), name
        for path, data in committed.items():
            assert regenerated[path] == data, f"{name}/{path}"
