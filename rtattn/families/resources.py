"""What every family's resource model reads: the device limits (real ones at run time, named
descriptions per arch for ahead-of-time builds), occupancy by shared memory and by the loaded
kernel, the fixed grid, and the variant lookup. (A launch, as a list of kernel calls, is
rtattn.runtime.launch's.)"""
from __future__ import annotations

from rtattn.plan import devices as plan_devices

MERGE_CTAS_PER_SM = 2   # the merge kernel's __launch_bounds__(256, 2)
ARCH_DEVICES = {"sm_80": "a100", "sm_86": "a100", "sm_89": "a100", "sm_90": "h200", "sm_90a": "h200"}


def variant_spec(variant, dtype: str, head_dim: int, kv_dtype: str | None = None, **tile):
    """A built-in variant's name (with the family's tile fields) or a user's AttentionSpec,
    checked against the wrapper's head_dim and element types (kv_dtype None: q's)."""
    from rtattn.codegen.spec import BUILTINS, AttentionSpec
    if isinstance(variant, AttentionSpec):
        want = AttentionSpec("x", "x", dtype=dtype, kv_dtype=kv_dtype)   # the wrapper's types, resolved
        if variant.head_dim != head_dim or (variant.q_dtype, variant.kv_dtype) != (want.q_dtype, want.kv_dtype):
            raise ValueError(f"variant spec is for head_dim={variant.head_dim}, dtype={variant.q_dtype}, "
                             f"kv_dtype={variant.kv_dtype}; the wrapper has head_dim={head_dim}, "
                             f"dtype={want.q_dtype}, kv_dtype={want.kv_dtype}")
        return variant
    if variant not in BUILTINS:
        raise ValueError(f"unknown variant {variant!r}; built-ins are {sorted(BUILTINS)} "
                         f"(or pass an AttentionSpec)")
    return BUILTINS[variant](dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim, **tile)


def device_for_arch(arch: str) -> plan_devices.Device:
    """The named device whose limits an ahead-of-time build for `arch` assumes (the same numbers
    as the real device's: the source, and so the cache entry, are the same)."""
    try:
        return plan_devices.DEVICES[ARCH_DEVICES[arch]]
    except KeyError:
        raise ValueError(f"no device description for arch {arch!r}; known: {sorted(ARCH_DEVICES)}") from None


def blocks_by_smem(device: plan_devices.Device, smem: int, cap: int) -> int:
    """CTAs per SM that `smem` bytes of dynamic shared memory allow (with the runtime's per-block
    reservation), between 1 and cap."""
    return max(1, min(cap, device.smem_per_sm // (smem + device.smem_reserved_per_block)))


def resident_ctas(function, rendered, device) -> int:
    """CTAs per SM of a loaded attention kernel at its block size and shared memory (the
    driver's occupancy); refuses a kernel that cannot be resident at all."""
    n = function.occupancy(rendered.threads, rendered.smem_bytes)
    if n < 1:
        raise RuntimeError(f"{function.name} cannot be resident on {device.name} "
                           f"({rendered.smem_bytes} B shared memory, {function.attributes()})")
    return n


def grid_ctas(device, ctas_per_sm: int, num_kv_heads: int) -> int:
    """Fixed grid x: every SM busy with `ctas_per_sm` CTAs across the KV heads."""
    return max(1, device.props.sm_count * ctas_per_sm // num_kv_heads)
