"""One geometry: how a tensor is cut across ranks, in one package that everything which moves, checks or verifies
bytes reads.

* :mod:`~reshard.geometry.partition`: the partition kinds (``replicate``, ``shard``, ``grouped``, ``vocab``,
  ``packed``, ``heads``, ``replicated_heads``), their manifest form and their shape arithmetic (rank shapes,
  canonical shapes).
* :mod:`~reshard.geometry.padding`: a vocab dim's padding (padded sizes, the pad limit, pad rows cut off).
* :mod:`~reshard.geometry.cut`: :class:`Cut`, the one record of which canonical rows each rank's slice holds.
* :mod:`~reshard.geometry.tensors`: split and gather of torch tensors by a cut (imports torch; not re-exported).

Pure and torch-free but for ``tensors``.
"""

from reshard.geometry.cut import Cut, Run, slices_cut, split_cut
from reshard.geometry.padding import MAX_VOCAB_PAD_PER_RANK, cut_pad_rows, is_padded_vocab, padded_size, round_up
from reshard.geometry.partition import (
    Grouped,
    Heads,
    Packed,
    Partition,
    Replicate,
    ReplicatedHeads,
    Shard,
    Vocab,
    at_tp,
    canonical_shape,
    head_replicas,
    norm_dim,
    packed_piece_sizes,
    partition_from_dict,
    partition_to_dict,
    rank_shapes,
    split_sizes,
    tps_that_split,
    with_size,
)

__all__ = [
    "MAX_VOCAB_PAD_PER_RANK",
    "Cut",
    "Grouped",
    "Heads",
    "Packed",
    "Partition",
    "Replicate",
    "ReplicatedHeads",
    "Run",
    "Shard",
    "Vocab",
    "at_tp",
    "canonical_shape",
    "cut_pad_rows",
    "head_replicas",
    "is_padded_vocab",
    "norm_dim",
    "packed_piece_sizes",
    "padded_size",
    "partition_from_dict",
    "partition_to_dict",
    "rank_shapes",
    "round_up",
    "slices_cut",
    "split_cut",
    "split_sizes",
    "tps_that_split",
    "with_size",
]
