"""Writing Megatron-LM's ``torch`` format: ``iter_XXXXXXX/mp_rank_XX[_PPP]/model_optim_rng.pt`` and the tracker.

Each rank file holds ``model`` (the state dict, in the source's nesting: mcore's flat names, or the legacy
``language_model -> encoder -> ...`` dicts), ``args`` (the source's, or those the plan built for a
checkpoint of another framework, with the new tensor-, pipeline- and expert-parallel sizes and padded vocab),
``checkpoint_version`` and ``iteration``. With ``--pp N`` the layers are split evenly into N stages the
way Megatron-LM assigns them (the embedding on the first stage, the final norm and output layer on the
last; tied embeddings also on the last, as ``output_layer.weight``, the copy Megatron keeps there), each
stage numbering its layers from 0. Experts are written unsharded (expert-parallel size 1).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from reshard.config import SourceFacts
from reshard.errors import ReshardError
from reshard.layouts.base import ONE_RUN, RunFiles, SourceCheckpoint, TargetSpec
from reshard.layouts.common.torch_rank_writer import RankFilePlan, TorchRanksWriter
from reshard.layouts.megatron.args import PICKLE_MODULE, retarget_args
from reshard.layouts.megatron.reader import FILE_NAME, TRACKER
from reshard.layouts.megatron.stages import layer_of, stage_of, stage_of_layers, with_layer
from reshard.megatron.facts import MegatronFacts, args_of
from reshard.megatron.model import arg
from reshard.megatron.vocab import megatron_pad_multiple
from reshard.vocab import padded_sizes_possible

CHECKPOINT_VERSION = 3.0  # what Megatron-LM writes today (QKV interleaved per query group)
EMBEDDING = ("embedding.word_embeddings.weight", "language_model.embedding.word_embeddings.weight")


class MegatronWriter(TorchRanksWriter):
    """Writes the ``megatron`` layout (see the module docstring); a checkpoint of another framework is written
    as Megatron's converters write one, in ``release/``; non-tensor entries (``_extra_state``) come from the
    source rank whose rows the target rank starts with."""

    pickle_module = PICKLE_MODULE
    replicated_heads_refusal = "Megatron stores KV heads as query groups and cannot load copies of a KV head"

    def __init__(self, out_dir: Path, spec: TargetSpec, plan: RankFilePlan, run: RunFiles = ONE_RUN) -> None:
        self._args, self._stages = _args_and_stages(spec)
        self._release = megatron_facts(spec.source).release
        super().__init__(out_dir, spec, plan, run)  # lays out every rank file (templates needs the above)

    @classmethod
    def file_plan(cls, spec: TargetSpec) -> RankFilePlan:
        """Every rank's stage files (:meth:`rank_files`).

        Raises:
            ReshardError: no Megatron args, or a tensor whose shape differs between ranks (Megatron needs equal ones).
        """
        _args_and_stages(spec)
        uneven = sorted(
            {n for h in spec.rank_headers for n, t in h.items() if t.shape != spec.rank_headers[0][n].shape}
        )
        if uneven:
            raise ReshardError(
                f"Megatron needs every rank to hold equal shapes, but {uneven[0]} would differ between ranks",
                hint="drop --uneven: the megatron layout pads the vocab the Megatron way",
            )
        return super().file_plan(spec)

    @classmethod
    def rank_files(cls, spec: TargetSpec, rank: int, names: list[str]) -> list[tuple[PurePosixPath, set[str]]]:
        """One file per pipeline stage, ``<folder>/mp_rank_XX[_PPP]/model_optim_rng.pt``, holding the stage's
        tensors (the last of several stages also the tied embedding, its output layer)."""
        args, stages = _args_and_stages(spec)
        tied_head = [name for name in EMBEDDING if name in names][:1] if _tied_on_last(args, len(stages)) else []
        files = []
        for stage in range(len(stages)):
            held = {name for name in names if stage_of(name, stages) == stage}
            if stage == len(stages) - 1:
                held.update(tied_head)
            files.append((_stage_file(spec, rank, stage, len(stages)), held))
        return files

    @classmethod
    def pad_multiple(cls, tp: int, source: SourceCheckpoint, layout_facts: SourceFacts | None) -> int | None:
        """Megatron pads the vocab to ``make_vocab_size_divisible_by * tp`` (128 * tp by default)."""
        return megatron_pad_multiple(arg(megatron_args_of(source, layout_facts), "make_vocab_size_divisible_by"), tp)

    @classmethod
    def vocab_problems(
        cls, source: SourceCheckpoint, *, padded_rows: int | None, pad_multiple: int
    ) -> list[ReshardError]:
        """Megatron pads the vocab from the true size at start-up (``make_vocab_size_divisible_by * tp``): when
        nothing records the true size and the rows found could pad to different sizes at the target tp, the
        output would not load (``size mismatch for embedding.word_embeddings.weight``). Refuse, saying which."""
        if padded_rows is None or not isinstance(source.facts, MegatronFacts):
            return []
        divisible_by = arg(source.facts.args, "make_vocab_size_divisible_by")
        possible = padded_sizes_possible(padded_rows, megatron_pad_multiple(divisible_by, source.tp), pad_multiple)
        if len(possible) <= 1:
            return []
        sizes = "; ".join(f"{padded} rows for a true size of {r.start}-{r.stop - 1}" for padded, r in possible.items())
        return [
            ReshardError(
                f"the true vocab size is unknown and Megatron pads it for the target tp: the {padded_rows} rows here "
                f"could become {sizes}",
                path=source.path,
                hint="pass --vocab N (the tokenizer's size, which Megatron-LM recomputes at start-up)",
            )
        ]

    def templates(self, rank: int, state_dict: dict[str, Any]) -> list[Any]:
        source, facts = self.spec.source, megatron_facts(self.spec.source)
        extras = source.extras[rank * source.tp // self.spec.tp] if isinstance(source.facts, MegatronFacts) else {}
        paths, pp = facts.paths, len(self._stages)
        args = retarget_args(self._args, self.spec.tp, self.spec.padded_vocab_size, pp=pp)
        objects = []
        for stage, layers in enumerate(self._stages):
            model: dict[str, Any] = {}
            for name in _stage_names(state_dict.keys() | extras.keys(), list(paths), self._stages, stage):
                value = state_dict[name] if name in state_dict else extras[name]
                _put(model, _local_path(paths.get(name, (name,)), layers.start), value)
            if stage == pp - 1 and _tied_on_last(self._args, pp):
                _put_tied_head(model, state_dict)
            version, iteration = facts.checkpoint_version, facts.iteration
            objects.append({"args": args, "checkpoint_version": version, "iteration": iteration, "model": model})
        return objects

    def finish(self) -> list[Path]:
        tracker = "release" if self._release else str(int(megatron_facts(self.spec.source).iteration or 0))
        (self.out_dir / TRACKER).write_text(tracker + "\n")
        return [Path(TRACKER)]


def _args_and_stages(spec: TargetSpec) -> tuple[Any, list[range]]:
    """The args to write and the layers of each pipeline stage (``spec.pp`` of them, split as Megatron-LM does)."""
    args = megatron_args_of(spec.source, spec.layout_facts)
    return args, stage_of_layers(int(arg(args, "num_layers", 0) or _layers(spec)), spec.pp)


def _tied_on_last(args: Any, pp: int) -> bool:
    """Whether the last of ``pp`` stages keeps its own copy of tied embeddings (Megatron's output layer)."""
    return pp > 1 and not arg(args, "untie_embeddings_and_output_weights", False)


def _stage_file(spec: TargetSpec, rank: int, stage: int, pp: int) -> PurePosixPath:
    """Where rank ``rank``'s stage ``stage`` goes: ``release/`` for a new checkpoint, else ``iter_XXXXXXX/``."""
    facts = megatron_facts(spec.source)
    folder = "release" if facts.release else f"iter_{int(facts.iteration or 0):07d}"
    return PurePosixPath(folder, f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else ""), FILE_NAME)


def _layers(spec: TargetSpec) -> int:
    numbers = [layer_of(name) for name in spec.rank_headers[0]]
    return max((n for n in numbers if n is not None), default=-1) + 1


def _stage_names(names: set[str], order: list[str], stages: list[range], stage: int) -> list[str]:
    """The global names that belong to one stage, in the source's order (``order``), then any others."""
    known = [name for name in order if name in names]
    ordered = known + sorted(names - set(known))
    return [name for name in ordered if stage_of(name, stages) == stage]


def _local_path(path: tuple[str, ...], first_layer: int) -> tuple[str, ...]:
    """A key path with its layer number made stage-local."""
    return tuple(_local_part(part, first_layer) for part in path)


def _local_part(part: str, first_layer: int) -> str:
    """One key of a path with its layer number, if any, made stage-local."""
    layer = layer_of(part)
    return part if layer is None else with_layer(part, layer - first_layer)


def _put_tied_head(model: dict[str, Any], state_dict: dict[str, Any]) -> None:
    """The last stage's copy of tied embeddings, under the name Megatron gives it there (mcore's flat
    ``output_layer.weight``, legacy ``word_embeddings_for_head -> weight``)."""
    mcore, legacy = EMBEDDING
    if mcore in state_dict:
        _put(model, ("output_layer.weight",), state_dict[mcore])
    elif legacy in state_dict:
        _put(model, ("word_embeddings_for_head", "weight"), state_dict[legacy])


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def megatron_facts(source: SourceCheckpoint) -> MegatronFacts:
    """The source's Megatron facts, else those of a new checkpoint: saved as ``release``, iteration 0, the
    current format version."""
    if isinstance(source.facts, MegatronFacts):
        return source.facts
    return MegatronFacts(iteration=0, checkpoint_version=CHECKPOINT_VERSION, release=True)


def megatron_args_of(source: SourceCheckpoint, layout_facts: SourceFacts | None) -> Any:
    """The args to write: those the mapping made for the target (``layout_facts``: a checkpoint of another framework
    mapped to Megatron), else the source's."""
    args = args_of(layout_facts) or args_of(source.facts)
    if args is None:
        raise ReshardError(
            "the megatron layout needs Megatron args: from a Megatron source, or a transformers model reshard maps",
            path=source.path,
            hint="convert a Megatron or transformers Llama-family checkpoint, or choose --layout hf / hf-ranks",
        )
    return args
