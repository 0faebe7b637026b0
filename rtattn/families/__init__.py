"""Kernel families: one module per family owns its tile policy, its resource model (shared
memory, CTAs per SM, from the device's limits) and the list of kernels a launch enqueues.

    decode   CUDA-core-shaped rows (tokens x head group <= 32) per CTA, KV split over warps
             (rtattn.kernels, codegen.render.decode_smem_bytes, plan.tiles)
    prefill  tensor-core query tiles of 16-128 fused rows, FlashAttention-2 style (prefill.py)
"""
