"""Megatron's names and tokenizers mapped to transformers': :mod:`~reshard.mappings.megatron.gpt` (the name table)
and :mod:`~reshard.mappings.megatron.tokenizer` (Megatron-LM's tokenizer types as transformers tokenizers). What
they read of Megatron's args and the ``config.json`` they imply is :mod:`reshard.megatron`."""
