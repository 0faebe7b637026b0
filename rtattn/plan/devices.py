"""Device descriptions the planner needs, named or read from a real device.

Named descriptions let an H200 plan be made on a CPU-only machine.  `from_props`
takes the runtime's DeviceProps (rtattn.runtime.driver) by duck typing, so this
module never imports the driver layer.
"""
from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class Device:
    name: str
    sm_count: int
    smem_per_sm: int            # bytes of shared memory per SM
    smem_per_block_optin: int   # max dynamic shared memory one block may opt into
    regs_per_sm: int
    l2_bytes: int
    cc: tuple[int, int]
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    smem_reserved_per_block: int = 1 * KiB   # the runtime's per-block reservation (sm80+)


DEVICES: dict[str, Device] = {
    "h200": Device("h200", 132, 228 * KiB, 227 * KiB, 65536, 60 * MiB, (9, 0)),
    "h100": Device("h100", 132, 228 * KiB, 227 * KiB, 65536, 50 * MiB, (9, 0)),
    "a100": Device("a100", 108, 164 * KiB, 163 * KiB, 65536, 40 * MiB, (8, 0)),
}


def get_device(dev) -> Device:
    """A Device from a name ('h200'), a Device, or a DeviceProps-like object."""
    if isinstance(dev, Device):
        return dev
    if isinstance(dev, str):
        try:
            return DEVICES[dev.lower()]
        except KeyError:
            raise ValueError(f"unknown device {dev!r}; known: {sorted(DEVICES)}") from None
    return from_props(dev)


def from_props(props) -> Device:
    """Build a Device from an object with name, sm_count, smem_per_sm,
    smem_per_block_optin, regs_per_sm, l2_bytes, cc (duck typed)."""
    try:
        cc = tuple(int(x) for x in props.cc)
        return Device(str(props.name), int(props.sm_count), int(props.smem_per_sm),
                      int(props.smem_per_block_optin), int(props.regs_per_sm),
                      int(props.l2_bytes), (cc[0], cc[1]))
    except AttributeError as e:
        raise TypeError(f"from_props needs a DeviceProps-like object: {e}") from None
