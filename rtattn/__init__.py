"""rtattn: framework-free attention engine for LLM serving (cuda-python driver API).

    import rtattn
    w = rtattn.BatchDecodeWrapper(32, 8, 128, 16, max_batch=256, max_pages=65536)
    w.plan(kv_indptr, kv_indices, kv_last_page_len)   # host arrays, once per step
    out = w.run(q, k_cache, v_cache)                   # DLPack tensors, once per layer

Importing rtattn never needs a GPU; asking for a device without one raises NoDeviceError.
"""
from rtattn.codegen.spec import AttentionSpec, Param, custom_variant
from rtattn.merge import merge_state, merge_states
from rtattn.runtime import NoDeviceError, has_device
from rtattn.wrapper import BatchDecodeWrapper

__all__ = ["BatchDecodeWrapper", "AttentionSpec", "Param", "custom_variant", "merge_state", "merge_states",
           "NoDeviceError", "has_device"]
