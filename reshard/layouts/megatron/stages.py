"""Pipeline stages, virtual chunks and expert-parallel ranks of Megatron-LM's ``torch`` format, as global names.

Megatron numbers layers and experts locally in each file: the layers of pipeline stage ``p`` (and of
virtual chunk ``c``) start again at 0, and so do the ``local_experts`` of expert-parallel rank ``e``.
Reading merges them into the model's global numbering, so that a checkpoint at any pp/ep is one model:

* a layer's global index is its local index plus the layers of every (chunk, stage) before it, in
  Megatron's order: chunk by chunk, and within a chunk stage by stage (``TransformerBlock`` gives chunk
  ``c`` of stage ``p`` the layers from ``c * L / v + p * L / (v * pp)`` on when layers split evenly; the
  counts found in the files also cover uneven first and last stages);
* an expert's global index is ``e * local_experts + local``;
* writing ``--pp N`` splits the layers evenly the way Megatron-LM assigns them, the embedding on the
  first stage and the final norm and output layer on the last.

Pure: names and counts in, names and numbers out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from reshard.errors import ReshardError

LAYER = re.compile(r"(?<=layers\.)(\d+)(?=\.)")
EXPERT = re.compile(r"(?<=local_experts\.)(\d+)(?=\.)")
# Tensors of the first stage (before the layers) and of the last (after them).
FIRST_STAGE = re.compile(r"(^|\.)(embedding|word_embeddings|position_embeddings)\b")
LAST_STAGE = re.compile(r"(^|\.)(final_layernorm|final_norm|output_layer|word_embeddings_for_head)\b")


def layer_of(name: str) -> int | None:
    match = LAYER.search(name)
    return None if match is None else int(match.group(1))


def with_layer(name: str, index: int) -> str:
    """``name`` with its (first) layer number replaced."""
    return LAYER.sub(str(index), name, count=1)


def expert_of(name: str) -> int | None:
    match = EXPERT.search(name)
    return None if match is None else int(match.group(1))


def with_expert(name: str, index: int) -> str:
    return EXPERT.sub(str(index), name, count=1)


def layer_counts(names: Iterable[str]) -> int:
    """How many layers a model chunk holds: its highest local layer number + 1 (0 without layers)."""
    numbers = [n for n in (layer_of(name) for name in names) if n is not None]
    return max(numbers) + 1 if numbers else 0


def layer_offsets(counts: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """The global index of the first layer of each ``(chunk, stage)``: chunks in order, stages in order."""
    offsets, offset = {}, 0
    for key in sorted(counts):
        offsets[key] = offset
        offset += counts[key]
    return offsets


def stage_of_layers(num_layers: int, pp: int) -> list[range]:
    """The global layers of each of ``pp`` stages, split evenly as Megatron-LM does by default.

    Raises:
        ReshardError: the layers do not split evenly (Megatron would need ``--decoder-first-pipeline-num-layers``).
    """
    if pp < 1 or num_layers % pp:
        raise ReshardError(
            f"{num_layers} layers do not split evenly into {pp} pipeline stages",
            hint="choose --pp as a divisor of the number of layers",
        )
    per = num_layers // pp
    return [range(p * per, (p + 1) * per) for p in range(pp)]


def stage_of(name: str, stages: list[range]) -> int:
    """The stage a global tensor name belongs to: its layer's, else first (embeddings) or last (head, final norm).

    Raises:
        ReshardError: the layer is in none of the stages.
    """
    layer = layer_of(name)
    if layer is not None:
        found = [p for p, layers in enumerate(stages) if layer in layers]
        if not found:
            total = sum(len(layers) for layers in stages)
            raise ReshardError(
                f"layer {layer} is past the {total} layers the pipeline stages hold",
                tensor=name,
                hint="the args' num_layers and the tensors disagree",
            )
        return found[0]
    if LAST_STAGE.search(name):
        return len(stages) - 1
    return 0
