"""One field list -> a C struct and the ctypes.Structure with the same layout.

Kernels take a single `const __grid_constant__ Params p`; the host packs the same struct with
ctypes. Declaring the members once and generating both sides keeps them from drifting.
"""
from __future__ import annotations

import ctypes
import functools
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
