"""Opening a DeepSpeed checkpoint imports neither torch nor DeepSpeed: its pickles are read structurally, and each
tensor is located as byte ranges of the files (what ``inspect`` and the planning of a conversion need), so the
1-2 s import of torch is not paid before the first byte moves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fixtures import deepspeed_listing
from fixtures.deepspeed import VARIANTS

TAG = "global_step2"
CASES = [
    *(f"{variant}:master" for variant in VARIANTS),
    *(f"{variant}:module" for variant in VARIANTS if not variant.startswith("zero3")),
    f"zero2_bf16/{TAG}:master",
    f"zero2_bf16/{TAG}_universal:master",
    f"zero3_bf16/{TAG}_universal:master",
]


def test_every_zero_checkpoint_opens_without_torch_with_the_same_pieces(ds_root):
    """ZeRO-1/2/3 in bf16, fp16 and fp32, the master weights and the module copy, the universal checkpoints: in a
    fresh interpreter, every tensor's header and byte ranges are those the open in this process gives (and those
    the earlier ``torch.load`` path gave: the other tests read these ranges against DeepSpeed's own output), and
    torch was not imported."""
    command = [sys.executable, deepspeed_listing.__file__, str(ds_root), *CASES]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    fresh = json.loads(done.stdout)
    assert fresh["torch imported"] is False
    here = json.loads(json.dumps(deepspeed_listing.listing(ds_root, CASES)))
    for case in CASES:
        assert fresh["listing"][case] == here[case], case
        tensors = here[case]["tensors"]
        assert len(tensors) == 21 and all(entry["pieces"] for entry in tensors.values()), case
    module = here["zero2_bf16:module"]["tensors"]["model.layers.0.mlp.down_proj.weight"]
    assert module["code"] == "BF16" and module["pieces"][0][0].endswith("mp_rank_00_model_states.pt")


@pytest.mark.parametrize("variant", ["zero2_bf16", "zero3_fp32"])
def test_a_class_deepspeed_does_not_pickle_is_refused_by_name(ds_copy, variant, cli, tmp_path):
    """The structure-only reader runs nothing; a class that is neither DeepSpeed's nor a tensor's is refused as
    ``torch.load(weights_only=True)`` refused it (``--trust-pickle`` reads it as an inert object)."""
    from argparse import Namespace

    import torch

    folder = ds_copy(variant)
    zero3 = variant.startswith("zero3")
    file = folder / TAG / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if zero3 else "mp_rank_00_model_states.pt")
    states = torch.load(file, weights_only=True)
    states["args"] = Namespace(lr=0.1)  # Megatron-DeepSpeed's client state
    torch.save(states, file)
    refused = cli("inspect", folder)
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert file.name in refused.output and "argparse.Namespace" in refused.output
    trusted = cli("inspect", folder, "--trust-pickle", "--json")
    assert trusted.exit_code == 0, trusted.output
    assert len(json.loads(trusted.stdout)["tensors"]) == 21
