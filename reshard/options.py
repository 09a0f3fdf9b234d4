"""The options of a command, filled once from the command line (or by a library caller) and passed down whole."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from reshard.errors import ReshardError

# The most ranks reshard reads or writes: far above any tensor-parallel size in use (8-64), and low enough
# that a rank number or tp from a damaged file (rank_999999999, "tp": 10**12) is refused, not enumerated.
MAX_RANKS = 4096


def check_tp(tp: int, *, what: str = "--tp") -> int:
    """``tp`` when it is a rank count reshard handles (1 .. :data:`MAX_RANKS`), else a one-line error."""
    try:
        count = operator.index(tp) if not isinstance(tp, bool) else None  # numpy integers too, not True
    except TypeError:
        count = None
    if count is None or not 1 <= count <= MAX_RANKS:
        raise ReshardError(f"{what} {tp!r} is not a number of ranks from 1 to {MAX_RANKS}")
    return count


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_jobs(*, in_memory: bool = False) -> int:
    """Twice the cores this process may run on; the cores when the checkpoint and the output are both in memory.

    A job spends much of its time waiting for its tensor's reads and writes (direct requests, see
    :mod:`reshard.io.direct`), so with one job per core the disk idles while every job hashes; memory does not
    grow with jobs (see :mod:`reshard.engine.move.execute`). In memory (tmpfs) no job waits for a device, and jobs
    beyond the cores only take turns on the interpreter and on the output files (measured: docs/performance.md).
    """
    return cores() if in_memory else 2 * cores()


@dataclass(frozen=True)
class ReadOptions:
    """How to open a checkpoint and decide every tensor's partition (what every command shares).

    Attributes:
        config: an explicit ``config.json`` (else found in or above the checkpoint, or the layout's own).
        plan: a user plan file whose rules come before the built-in plan, or ``"transformers"``.
        trust_pickle: fully unpickle torch files (only for files the user trusts).
        vocab: the true vocab size; None takes it from the manifest, then the config.
        allow_vocab_shrink: accept a ``vocab`` below the true size the manifest or config gives (drops rows).
        uneven: read and split sizes that do not divide as ``torch.chunk`` does.
        merge_lora: merge LoRA adapters into their base weights on every source rank first.
        lora_alpha: LoRA alpha (scaling = alpha / rank) where no ``adapter_config.json`` records it; None: SAT's
            ``lora2`` names take SAT's default 1, peft's names need it recorded.
        adapter: the peft adapter to merge or write, of several in one checkpoint (the name in its keys).
        lora_adapter: open the source narrowed to its LoRA adapter under PEFT's saved names (a conversion into
            PEFT's adapter folder sets it; :attr:`reshard.layouts.spec.LayoutSpec.lora_adapter`).
        base_model: the base model's id or path an adapter folder names (``base_model_name_or_path``); None: the
            recorded adapter config's, else the source config's ``_name_or_path``.
        tokenizer: the tokenizer an HF output carries (``--tokenizer``): a folder, or a Hub repo id as the user
            wrote it; None takes the one the checkpoint names or holds.
        weights: which copy of the weights to read where a checkpoint keeps two (DeepSpeed ZeRO-0/1/2):
            ``master`` (the fp32 master weights of the optimizer, what training continues from) or ``module``
            (the copy in the training dtype).
    """

    config: Path | None = None
    plan: Path | str | None = None
    trust_pickle: bool = False
    vocab: int | None = None
    allow_vocab_shrink: bool = False
    uneven: bool = False
    merge_lora: bool = False
    lora_alpha: float | None = None
    adapter: str | None = None
    lora_adapter: bool = False
    base_model: str | None = None
    tokenizer: Path | str | None = None
    weights: str = "master"


@dataclass(frozen=True)
class ConvertOptions:
    """How to read the source (``read``) and what to write.

    Attributes:
        tp: target number of ranks (1: a canonical full checkpoint).
        pp: pipeline stages to write (``megatron``; ``torch_dist`` records it in the args).
        layout: target layout (``hf``, ``hf-ranks``, ``megatron``, ``sat``, ``torch_dist``); None picks from the
            source.
        read: how to open the source (:class:`ReadOptions`: its config, plan, true vocab, ``--uneven``, LoRA, ...).
        pad_multiple: pad the vocab to a multiple of this (default: the target tp, or the layout's rule).
        max_shard_size: largest safetensors file before a new shard starts (``"5GB"`` or bytes).
        overwrite: replace an existing non-empty output.
        allow_divergent_replicas: take rank 0 of a replicated tensor that differs between ranks.
        progress: show tqdm progress bars on stderr.
        jobs: tensors read, gathered, hashed and written at once; None: :func:`default_jobs` for where the
            checkpoint and the output are.
        keep_names: keep the source's tensor names even where the target layout's framework names them
            otherwise (a Megatron checkpoint written as ``hf`` keeps Megatron's names and fused tensors).
        resume: stage the output under a fixed name with a journal (:mod:`reshard.io.journal`), keep it when the
            run fails or is stopped, and finish what an earlier such run left there.
        dtype: write every floating tensor in this dtype (``bfloat16``, ``float16``, ``float32``), FP8 weights
            dequantized with their scales (the scales and ``quantization_config`` dropped); None keeps each dtype.
        force: ``fix`` writes its output even when the checkpoint needs nothing (no tensor changes shape and the
            vocab is already its true size); without it such a ``fix`` says so and writes nothing.
        with_optimizer: carry the training state (fp32 masters, Adam's moments, step, param groups) with the
            weights, each parameter's state along its weight's path (:mod:`reshard.engine.plan.training`).
        drop: the kinds of training state not carried that the user agrees to leave behind (``rng``,
            ``scheduler``, ...: :data:`reshard.layouts.training.LEFTOVER_KINDS`); any other kind the source holds
            refuses ``with_optimizer``.
    """

    tp: int = 1
    pp: int = 1
    layout: str | None = None
    read: ReadOptions = field(default_factory=ReadOptions)
    pad_multiple: int | None = None
    max_shard_size: int | str = "5GB"
    overwrite: bool = False
    allow_divergent_replicas: bool = False
    progress: bool = True
    jobs: int | None = None
    keep_names: bool = False
    resume: bool = False
    dtype: str | None = None
    force: bool = False
    with_optimizer: bool = False
    drop: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        check_tp(self.tp)


Options = TypeVar("Options")


def composed(kind: Callable[..., Options], **params: Any) -> Options:
    """``kind`` (:class:`ConvertOptions`, or a command's options with a ``read`` part) from flat parameters, as a
    command line gives them: those that say how to open a checkpoint make its :class:`ReadOptions`."""
    reading = {f.name for f in fields(ReadOptions)}
    read = ReadOptions(**{name: params.pop(name) for name in list(params) if name in reading})
    return kind(read=read, **params)
