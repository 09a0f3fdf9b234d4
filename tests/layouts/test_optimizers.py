"""The table of optimizers (pure): what a checkpoint's recorded name, state keys and group keys say it is, and what
is refused, by name. Real optimizers' bytes are in ``tests/layouts/dcp/test_dcp_optimizers.py``; here the names
DeepSpeed records (``ds_config.optimizer.type``) and the keys' edge cases."""

from __future__ import annotations

import pytest

from reshard.layouts.optimizers import ADAGRAD, ADAM, MUON, SGD, UnknownOptimizer, recognise

ADAM_STATE = ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize(
    ("recorded", "keys", "groups", "expected"),
    [
        ("AdamW", ADAM_STATE, (), ADAM),
        (None, ADAM_STATE, (), ADAM),  # a client optimizer: not named
        ("FusedAdam", ADAM_STATE, (), ADAM),
        ("SGD", ("momentum_buffer",), (), SGD),  # DeepSpeed builds any torch.optim class by name
        (None, ("momentum_buffer",), SGD.keys, SGD),
        (None, ("momentum_buffer",), MUON.keys, MUON),  # Muon's group keys tell it from SGD
        (None, (), MUON.keys, MUON),
        (None, (), SGD.keys, SGD),  # SGD without momentum keeps no state: its group keys say it
        (None, ("sum",), (), ADAGRAD),
        (None, (*ADAM_STATE, "max_exp_avg_sq"), (), ADAM),
    ],
)
def test_what_a_state_is_carried_as(recorded, keys, groups, expected) -> None:
    assert recognise(recorded, keys, groups) is expected


@pytest.mark.parametrize(
    ("recorded", "keys", "groups", "said"),
    [
        ("FusedLion", ("exp_avg",), (), "optimizer 'FusedLion' is Lion: reshard carries"),
        ("OneBitAdam", ADAM_STATE, (), "is 1-bit Adam: its error-feedback buffers are per data-parallel rank"),
        ("Adagrad", ("exp_avg_sq",), (), "keeps exp_avg_sq per parameter, which Adagrad does not (sum)"),
        ("Lamb", ADAM_STATE, (), "optimizer 'Lamb' is LAMB"),
        ("soap", ADAM_STATE, (), "optimizer 'soap' is SOAP: its preconditioners are per-dimension matrices"),
        ("dist_muon", ("momentum_buffer",), (), "optimizer 'dist_muon' is Megatron's distributed Muon"),
        (None, ("momentum_buffer", "exp_avg", "exp_avg_sq"), (), "keeps momentum_buffer per parameter, which Adam"),
        (None, (), ("lr",), "its param groups' keys (lr), without per-parameter state, match no optimizer"),
    ],
)
def test_what_is_refused_by_name(recorded, keys, groups, said) -> None:
    with pytest.raises(UnknownOptimizer) as caught:
        recognise(recorded, keys, groups)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_required_slots_follow_the_hyper_parameters() -> None:
    assert SGD.required({"momentum": 0}) == () and SGD.required({"momentum": 0.9}) == ("momentum_buffer",)
    assert ADAM.required({"amsgrad": False}) == ADAM_STATE
    assert ADAM.required({"amsgrad": True}) == (*ADAM_STATE, "max_exp_avg_sq")
