"""One field list -> a C struct and the ctypes.Structure with the same layout.

Kernels take a single `const __grid_constant__ Params p`; the host packs the same struct with
ctypes. Declaring the members once and generating both sides keeps them from drifting.
"""
from __future__ import annotations

import ctypes
import functools
import struct as _struct
from dataclasses import dataclass

# C spelling -> ctypes type. Every pointer is 8 bytes; its C spelling only matters to the kernel.
_SCALARS = {
    "int": ctypes.c_int32,
    "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}


def ctype_of(c_type: str):
    if c_type.rstrip().endswith("*"):
        return ctypes.c_void_p
    try:
        return _SCALARS[c_type.replace("const ", "").strip()]
    except KeyError:
        raise TypeError(f"unsupported C type {c_type!r} for a kernel parameter "
                        f"(use one of {sorted(_SCALARS)} or a pointer)") from None


@dataclass(frozen=True)
class Member:
    name: str
    c_type: str          # C spelling, e.g. "const float*", "int64_t", or a nested struct name
    nested: "CStruct | None" = None


@dataclass(frozen=True)
class CStruct:
    name: str
    members: tuple[Member, ...]

    def c_source(self) -> str:
        body = "".join(f"  {m.c_type} {m.name};\n" for m in self.members)
        return f"struct {self.name} {{\n{body}}};\n"

    @functools.lru_cache(maxsize=None)
    def ctypes_type(self) -> type[ctypes.Structure]:
        fields = [(m.name, m.nested.ctypes_type() if m.nested else ctype_of(m.c_type)) for m in self.members]
        return type(self.name, (ctypes.Structure,), {"_fields_": fields})

    def pack(self, **values) -> bytes:
        """Bytes of the struct; every member must be given (nested structs as dicts)."""
        missing = {m.name for m in self.members} - set(values)
        extra = set(values) - {m.name for m in self.members}
        if missing or extra:
            raise ValueError(f"{self.name}: missing members {sorted(missing)}, unknown {sorted(extra)}")
        return bytes(self._fill(self.ctypes_type()(), values))

    def _fill(self, obj, values):
        for m in self.members:
            val = values[m.name]
            if m.nested is not None:
                m.nested._fill(getattr(obj, m.name), val)
            else:
                setattr(obj, m.name, val)
        return obj


_FORMATS = {ctypes.c_void_p: "Q", ctypes.c_int32: "i", ctypes.c_uint32: "I", ctypes.c_int64: "q",
            ctypes.c_float: "f"}


def _member_layout(struct: CStruct, base: int = 0, prefix: str = "") -> dict:
    """name (dotted for nested members) -> (byte offset, struct format character)."""
    ct = struct.ctypes_type()
    out = {}
    for m in struct.members:
        off = base + getattr(ct, m.name).offset
        if m.nested is not None:
            out.update(_member_layout(m.nested, off, f"{prefix}{m.name}."))
        else:
            out[prefix + m.name] = (off, _FORMATS[ctype_of(m.c_type)])
    return out


class FieldWriter:
    """Writes the named members of a packed struct in place, in one struct.pack_into per run of
    adjacent members: what changes per call (tensor pointers, strides, scales) is rewritten,
    what is fixed for a wrapper's life stays as first packed. Pointers are ints (0 for null)."""

    def __init__(self, cstruct: CStruct, names):
        layout = _member_layout(cstruct)
        unknown = [n for n in names if n not in layout]
        if unknown:
            raise ValueError(f"{cstruct.name} has no members {unknown}")
        self.names = tuple(names)
        self.runs = []   # (Struct.pack_into, offset, first, end): values[first:end] go at offset
        first = 0
        for i, name in enumerate(self.names):
            off, fmt = layout[name]
            if i > first:
                prev_off, prev_fmt = layout[self.names[i - 1]]
                if off != prev_off + _struct.calcsize("=" + prev_fmt):
                    self._close(layout, first, i)
                    first = i
        if self.names:
            self._close(layout, first, len(self.names))

    def _close(self, layout, first: int, end: int) -> None:
        fmt = "=" + "".join(layout[n][1] for n in self.names[first:end])
        self.runs.append((_struct.Struct(fmt).pack_into, layout[self.names[first]][0], first, end))

    def __call__(self, buffer, values) -> None:
        """`values` in the order of `names`."""
        for pack_into, off, a, b in self.runs:
            pack_into(buffer, off, *values[a:b])

