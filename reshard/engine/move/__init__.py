"""Moving the bytes of a planned conversion: each unit streamed block by block (``stream``) or gathered into a pooled
buffer (``gather``, ``gathered``, ``buffers``), hashed and checked (``digest``), split by the target's cut and handed
to the writer (``execute``, the scheduler; ``work``: a unit's buffers and memory, before any byte moves)."""
