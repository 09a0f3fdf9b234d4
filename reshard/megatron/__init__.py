"""What reshard knows of Megatron-LM, pure and torch-free, in one place: the layouts, the mappings and the engine
read it here.

* :mod:`~reshard.megatron.model`: what Megatron's pickled ``args`` say of the model (its shape as a
  :class:`~reshard.config.ModelConfig`, its true vocab size, the tokenizer they name, layer and expert counts).
* :mod:`~reshard.megatron.vocab`: the multiple Megatron pads its vocab to.
* :mod:`~reshard.megatron.args`: every Megatron-LM argument classified (carried, irrelevant or refused), against
  :mod:`~reshard.megatron.defaults` (Megatron-LM's defaults per release, written by ``scripts/megatron_defaults.py``).
* :mod:`~reshard.megatron.config`: a Megatron GPT's architecture and the ``config.json`` of the same model.

Megatron's knowledge that needs a lower layer lives beside that layer's other families: the layout that reads and
writes its files (:mod:`reshard.layouts.megatron`, and ``torch_dist`` in :mod:`reshard.layouts.dcp`), the plan of
its tensors' partitions (:mod:`reshard.plans.megatron`, one of the plans' ``FAMILIES``), and the name table and
tokenizer carried to transformers (:mod:`reshard.mappings.megatron`). This package imports nothing from them.
"""
