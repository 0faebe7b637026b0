"""Kernel families: one module per family owns its tile policy, its resource model (shared
memory, stages, CTAs per SM, from the device's limits) and the list of kernels a launch enqueues.

    decode   16 or 32 fused rows (tokens x head group) per CTA, KV split over warps (decode.py)
    prefill  tensor-core query tiles of 16-128 fused rows, FlashAttention-2 style (prefill.py)
"""
