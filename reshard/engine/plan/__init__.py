"""Planning a conversion from headers, before any byte moves: open a checkpoint and decide every tensor's partition
and canonical shape (``open``, ``planner``), then the target's names, partitions and rank shapes (``target``); the
tokenizer and the LoRA merge are decided here too. Pure but for the replica check inference may ask for."""
