"""``--with-optimizer`` planning on plain data (``reshard.engine.plan.training``): each trainable parameter's state
tensors get its weight's unit of work (cut, target shape, per-rank shapes, transform) with their own slices and
dtype; what cannot follow exactly is refused by name before any byte moves. Headers only: reading bytes fails."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from engine.plan.test_planner import EMBED, HEAD, NORM, TP2, K, NoBytes, Q, checkpoint

from reshard.dtypes import TensorHeader
from reshard.engine.plan.planner import ConversionPlan, TensorPlan, plan_conversion, plan_sources
from reshard.engine.plan.training import plan_training
from reshard.errors import PlanError, ReshardError
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.layouts.training import Leftover, ParamGroup, TrainingState, state_name
from reshard.mappings.transforms import DropZeros, Parallel, Rename
from reshard.plans.llama import LLAMA_PLAN
from reshard.vocab import VocabPlan

MOMENTS = ("exp_avg", "exp_avg_sq")


def with_state(
    source: SourceCheckpoint,
    groups: tuple[tuple[str, ...], ...],
    *,
    skip: tuple[str, int] | None = None,
    optimizer: str | None = "AdamW",
    leftovers: tuple[Leftover, ...] = (),
) -> SourceCheckpoint:
    """``source`` with Adam's moments (float32, the weights' rank shapes) for the parameters of ``groups``;
    ``skip``: one state tensor left out on one rank."""
    tensors = []
    for rank, refs in enumerate(source.ranks):
        headers = {
            state_name(name, moment): TensorHeader(refs[name].shape, "F32")
            for group in groups
            for name in group
            for moment in MOMENTS
            if (state_name(name, moment), rank) != skip
        }
        reader = NoBytes(Path(f"/nowhere/optim_{rank}.pt"), headers)
        tensors.append({key: TensorRef(key, rank, reader, key, header) for key, header in headers.items()})
    state = TrainingState(
        optimizer=optimizer,
        step=7,
        moments=MOMENTS,
        groups=tuple(ParamGroup({"lr": 0.01, "weight_decay": 0.1 * i}, g) for i, g in enumerate(groups)),
        not_carried=leftovers,
        tensors=tuple(tensors),
    )
    return replace(source, training=state)


def planned(source: SourceCheckpoint, target_tp: int, vocab: int = 14) -> ConversionPlan:
    """``source`` planned for ``target_tp`` ranks; its 14 vocab rows are the true vocab unless ``vocab`` says less."""
    tensors = plan_sources(source, LLAMA_PLAN, vocab_size=vocab, target_tp=target_tp)
    return plan_conversion(source, tensors, vocab=VocabPlan(vocab, "config.json"), target_tp=target_tp)


def states_of(conversion: ConversionPlan) -> dict[str, TensorPlan]:
    return {plan.name: plan for plan in conversion.tensors}


DECAY, NO_DECAY = (EMBED, HEAD, Q, K), (NORM,)


@pytest.mark.parametrize("target_tp", [1, 2, 4])
def test_each_moment_takes_its_weights_plan(target_tp):
    """At tp 1, 2 and 4 (the vocab of 14 rows padded to 16 at tp 4: those rows zero), every moment has its weight's
    partition, canonical shape, per-rank shapes and cut, float32, read from its own slices; frozen parameters have
    none."""
    source = with_state(checkpoint([TP2, TP2]), (DECAY, NO_DECAY))
    conversion, carried = plan_training(planned(source, target_tp), (), drop=frozenset())
    plans = states_of(conversion)
    trainable = DECAY + NO_DECAY
    assert set(plans) == set(TP2) | {state_name(n, m) for n in trainable for m in MOMENTS}
    for name in trainable:
        (weight,) = plans[name].targets
        for moment in MOMENTS:
            state = plans[state_name(name, moment)]
            (target,) = state.targets
            assert (target.partition, target.shape, target.rank_shapes) == (
                weight.partition, weight.shape, weight.rank_shapes,
            )  # fmt: skip
            assert target.code == "F32" and target.cut == weight.cut
            (source_tensor,) = state.sources
            assert [ref.key for ref in source_tensor.refs] == [state_name(name, moment)] * 2
            assert source_tensor.cut == plans[name].sources[0].cut
    assert carried.step == 7 and carried.slots == MOMENTS
    assert set(carried.frozen) == {n for n in TP2 if n not in trainable}
    assert [g.params for g in carried.groups] == [DECAY, NO_DECAY]
    assert [g.hyper["weight_decay"] for g in carried.groups] == [0.0, 0.1]


def test_trained_padding_rows_are_refused_unless_carried_as_rows():
    """13 true rows in 14: the padding row was trained (Megatron's softmax covers it), so cutting it is refused."""
    source = with_state(checkpoint([TP2, TP2]), (DECAY, NO_DECAY))
    with pytest.raises(ReshardError) as err:
        plan_training(planned(source, 1, vocab=13), (), drop=frozenset())
    assert "the vocab tensors hold 14 rows for a vocab of 13 (config.json): the 1 padding rows were trained" in str(
        err.value
    )
    assert err.value.hint == "carry them as rows with --vocab 14"


def test_a_trainable_parameter_without_a_moment_on_one_rank_is_refused_by_name():
    source = with_state(checkpoint([TP2, TP2]), (DECAY,), skip=(state_name(Q, "exp_avg_sq"), 1))
    with pytest.raises(PlanError) as err:
        plan_training(planned(source, 1), (), drop=frozenset())
    assert f"{Q}: is a trainable parameter without its exp_avg_sq (rank(s) [1])" in str(err.value)


def test_what_no_target_carries_is_refused_unless_dropped():
    leftovers = (Leftover("scheduler", "lr_scheduler", "model states"), Leftover("rng", "rng_state.pth", "beside"))
    source = with_state(checkpoint([TP2, TP2]), (DECAY,), leftovers=leftovers)
    with pytest.raises(ReshardError) as err:
        plan_training(planned(source, 1), (), drop=frozenset({"rng"}))
    assert "holds training state no target carries: lr_scheduler (model states)" in str(err.value)
    assert err.value.hint == "leave it behind with --drop scheduler"
    plan_training(planned(source, 1), (), drop=frozenset({"rng", "scheduler"}))


@pytest.mark.parametrize(
    ("optimizer", "said"),
    [
        ("SGD", "the optimizer (SGD) keeps exp_avg, exp_avg_sq per parameter, which SGD does not (momentum_buffer)"),
        ("Adafactor", "optimizer 'Adafactor' is Adafactor: its second moment is factored"),
        ("Adam8bit", "optimizer 'Adam8bit' is 8-bit Adam (bitsandbytes): its moments are 8-bit codes"),
        ("Sophia", "optimizer 'Sophia' is not one reshard knows"),
    ],
)
def test_an_optimizer_whose_recorded_name_is_not_its_state_s_is_refused_by_name(optimizer, said):
    source = with_state(checkpoint([TP2, TP2]), (DECAY,), optimizer=optimizer)
    with pytest.raises(ReshardError) as err:
        plan_training(planned(source, 1), (), drop=frozenset())
    assert said in str(err.value)


def test_a_source_without_a_training_state_is_refused():
    with pytest.raises(ReshardError, match="holds no training state reshard reads"):
        plan_training(planned(checkpoint([TP2, TP2]), 1), (), drop=frozenset())


def test_a_trainable_parameter_the_mapping_drops_is_refused():
    source = with_state(checkpoint([TP2, TP2]), (DECAY,))
    with pytest.raises(PlanError, match=f"{K}: is a trainable parameter the conversion drops"):
        plan_training(planned(source, 1), (K,), drop=frozenset())


def units(conversion: ConversionPlan, transform, names: tuple[str, str]) -> ConversionPlan:
    """``conversion`` with the units of ``names`` made one unit through ``transform`` (as a mapping fuses)."""
    plans = states_of(conversion)
    fused = TensorPlan(tuple(plans[n].sources[0] for n in names), tuple(plans[n].targets[0] for n in names), transform)
    return replace(conversion, tensors=(*(p for p in conversion.tensors if p.name not in names), fused))


def test_a_unit_of_parameters_of_different_groups_is_refused():
    source = with_state(checkpoint([TP2, TP2]), ((Q,), (K,)))
    conversion = units(planned(source, 1), Parallel((Rename(), Rename())), (Q, K))
    with pytest.raises(PlanError, match=rf"makes one tensor of parameters of different groups: {Q} \(group 0\)"):
        plan_training(conversion, (), drop=frozenset())
    moved, _ = plan_training(units(planned(with_state(checkpoint([TP2, TP2]), ((Q, K),)), 1),
                                   Parallel((Rename(), Rename())), (Q, K)), (), drop=frozenset())  # fmt: skip
    fused = states_of(moved)[state_name(Q, "exp_avg")]
    assert [s.name for s in fused.sources] == [state_name(Q, "exp_avg"), state_name(K, "exp_avg")]
    assert [t.name for t in fused.targets] == [state_name(Q, "exp_avg"), state_name(K, "exp_avg")]


def test_a_transform_that_computes_values_is_refused():
    source = with_state(checkpoint([TP2, TP2]), ((Q, K),))
    conversion = units(planned(source, 1), DropZeros(), (Q, K))
    with pytest.raises(PlanError, match="computes its values, and an optimizer's state cannot follow"):
        plan_training(conversion, (), drop=frozenset())


def test_a_weight_read_from_a_trainable_parameters_bytes_is_tied_to_it():
    """A tied weight (DeepSpeed's ``shared_params``: the reader gives the alias its owner's slices) is neither
    frozen nor grouped: it is recorded ``(alias, owner)``, and has no state of its own."""
    source = checkpoint([TP2, TP2])
    ranks = [{**refs, HEAD: replace(refs[EMBED], name=HEAD)} for refs in source.ranks]
    source = with_state(replace(source, ranks=ranks), (tuple(n for n in DECAY if n != HEAD), NO_DECAY))
    conversion, carried = plan_training(planned(source, 2), (), drop=frozenset())
    assert carried.tied == ((HEAD, EMBED),)
    assert HEAD not in carried.frozen and all(HEAD not in g.params for g in carried.groups)
    assert not any(state_name(HEAD, m) in states_of(conversion) for m in MOMENTS)
