"""Open a checkpoint and plan it: the one step every command takes before any tensor byte moves.

:func:`open_checkpoint` finds the layout and reads the headers (:func:`reshard.layouts.discover`), applies
``--config``, merges LoRA adapters on request, finds the ``reshard.json`` beside it, resolves the true vocab
size (:func:`reshard.vocab.resolve_vocab`), selects the plan and decides every tensor's partition and
canonical shape (:func:`reshard.engine.plan.planner.plan_sources`). ``inspect`` reports the result, ``check``
checks it for another tp, ``convert`` and ``fix`` plan the target from it, ``verify`` gathers from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from reshard.config import find_config
from reshard.engine.plan.lora_adapter import adapter_source, lora_hint, peft_adapter
from reshard.engine.plan.lora_merge import merge_lora_source
from reshard.engine.plan.planner import SourceTensor, mixed_runs, plan_sources
from reshard.engine.plan.tokenizer import choose_tokenizer, with_tokenizer_vocab
from reshard.errors import ReshardError
from reshard.formats.tokenizer import Tokenizer
from reshard.hub.source import HubCheckpoint
from reshard.layouts import SourceCheckpoint, TensorRef, check_manifest, discover
from reshard.manifest import Manifest, find_manifest, written_uneven
from reshard.options import ReadOptions
from reshard.plans import Plan, check_family, select_plan
from reshard.plans.recorded import RecordedPlan
from reshard.vocab import VocabPlan, check_vocab_shrink, resolve_vocab


@dataclass(frozen=True)
class OpenedCheckpoint:
    """Everything known about a checkpoint before its bytes are read.

    Attributes:
        path: what the user named.
        source: the layout's view of it: ranks of lazy tensor references, config, notes.
        manifest: the ``reshard.json`` beside it, if any.
        plan: the plan its tensors were matched against.
        vocab: the true vocab size and where it came from.
        uneven: whether its sizes are split as ``torch.chunk`` does (``--uneven``, or as reshard wrote it).
        tensors: every tensor's partition and canonical shape, or its problem.
        tokenizer: the tokenizer ``--tokenizer`` or the checkpoint names (not an HF folder's own files, which are
            side files), when its files are here.
    """

    path: Path
    source: SourceCheckpoint
    manifest: Manifest | None
    plan: Plan
    vocab: VocabPlan
    uneven: bool
    tensors: tuple[SourceTensor, ...]
    tokenizer: Tokenizer | None = None

    @property
    def problems(self) -> list[ReshardError]:
        return [t.problem for t in self.tensors if t.problem]

    def by_name(self) -> dict[str, SourceTensor]:
        return {t.name: t for t in self.tensors}


def open_checkpoint(
    ckpt: Path | HubCheckpoint,
    options: ReadOptions,
    *,
    target_tp: int | None = None,
    recorded_plan: bool = False,
    read_bytes: bool = True,
    dequantize: bool = False,
) -> OpenedCheckpoint:
    """Open and plan ``ckpt`` (see the module docstring).

    Args:
        ckpt: the checkpoint folder or file, or a Hub repo (read from its safetensors headers only; see
            :mod:`reshard.hub.remote`).
        options: how to read it.
        target_tp: the tp it will be split for (a tp=1 tensor no rule covers can only stay whole at tp 1);
            None: its own tp.
        recorded_plan: read tensors the way its ``reshard.json`` recorded them, when it has one and no
            ``--plan`` is given (``verify`` judges a checkpoint as it was written).
        read_bytes: whether inference may read rank slices to tell replicated from split tensors
            (``check`` reads headers only, and so does any command on a Hub repo).
        dequantize: the weights will be dequantized (``convert --dtype``): a one-rank source's quantization scales
            are read whole with their weight (:func:`~reshard.engine.plan.planner.plan_sources`).

    Raises:
        ReshardError: the checkpoint cannot be read (no checkpoint, a missing rank, a corrupt header, ...).
    """
    if isinstance(ckpt, HubCheckpoint):
        from reshard.hub.remote import open_headers

        source, manifest = open_headers(ckpt, options)
        ckpt, read_bytes = source.path, False
    else:
        ckpt = Path(ckpt)
        source, manifest = discover(ckpt, options), find_manifest(ckpt)
    if options.config is not None:
        source.config = find_config(ckpt, options.config)
    if options.merge_lora or options.lora_adapter:
        source = _with_lora(source, options)
    else:
        source.notes.extend(lora_hint(source))
    check_manifest(source, manifest)
    tokenizer = choose_tokenizer(source, options.tokenizer)
    if tokenizer is not None:
        source.config = with_tokenizer_vocab(source, tokenizer, options.vocab)
    vocab = resolve_vocab(options.vocab, manifest, source.config)
    check_family(source.config, source.names())
    plan = select_plan(source.config, source.names(), plan_file=options.plan)
    if recorded_plan and manifest is not None and options.plan is None:
        plan = RecordedPlan.of(manifest, fallback=plan)
    uneven = options.uneven or written_uneven(manifest)
    tensors = plan_sources(
        source,
        plan,
        vocab_size=vocab.original,
        target_tp=source.tp if target_tp is None else target_tp,
        uneven=uneven,
        replicas_equal=_replicas_equal if read_bytes else None,
        dequantize=dequantize,
    )
    mixed = mixed_runs(source, tensors)
    if mixed is not None:
        raise mixed
    if not any(t.problem for t in tensors):  # a --vocab far below the rows is refused by name as more than padding
        check_vocab_shrink(vocab, manifest, source.config, source_tp=source.tp, allow=options.allow_vocab_shrink)
    return OpenedCheckpoint(ckpt, source, manifest, plan, vocab, uneven, tuple(tensors), tokenizer)


def _with_lora(source: SourceCheckpoint, options: ReadOptions) -> SourceCheckpoint:
    """``source`` merged (``--merge-lora``) or narrowed to its peft adapter (a PEFT adapter folder's target)."""
    peft = peft_adapter(source, options)
    if peft is None and options.adapter is not None:
        raise ReshardError(f"--adapter {options.adapter!r}, but it holds no peft LoRA adapter", path=source.path)
    if options.merge_lora:
        return merge_lora_source(source, alpha=options.lora_alpha, peft=peft)
    if peft is None:
        raise ReshardError(
            "holds no peft LoRA adapter (lora_A / lora_B tensors) to write as an adapter folder",
            path=source.path,
            hint="SAT's lora2 adapters: use --merge-lora" if any(".matrix_A." in n for n in source.names()) else None,
        )
    return adapter_source(source, peft, options)


def _replicas_equal(refs: Sequence[TensorRef]) -> bool:
    from reshard.geometry.tensors import bitwise_equal

    first = refs[0].read()
    return all(bitwise_equal(first, ref.read()) for ref in refs[1:])


__all__ = ["OpenedCheckpoint", "open_checkpoint"]
