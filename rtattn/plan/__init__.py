"""Host-side planning: layouts, tiles, Algorithm 1, the plan layout, references.

    from rtattn.plan import Planner
    p = Planner(max_batch, max_qo_tokens, max_pages, H_qo, H_kv, D, page_size,
                device="h200", mode="auto")
    info = p.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, out=pinned_u8)
"""
from .devices import DEVICES, Device, from_props, get_device
from .executor import execute_plan, merge_states
from .fields import PLAN_FIELDS, PlanBounds, PlanLayout, c_struct
from .inspector import PlanInfo, Planner
from .layout import Batch, check_heads, dense_kv, paged_kv, validate_batch
from .reference import Variant, reference_attention
from .tiles import TileConfig, select_tile

__all__ = ["DEVICES", "Device", "from_props", "get_device", "execute_plan", "merge_states",
           "PLAN_FIELDS", "PlanBounds", "PlanLayout", "c_struct", "PlanInfo", "Planner",
           "Batch", "check_heads", "dense_kv", "paged_kv", "validate_batch", "Variant",
           "reference_attention", "TileConfig", "select_tile"]
