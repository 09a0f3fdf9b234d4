"""Not a layout: what several layout packages share (the base writer of ``torch.save`` rank files, used by
``megatron`` and ``sat``). Nothing here is in :data:`reshard.layouts.LAYOUTS`, and nothing here detects or opens a
checkpoint."""
