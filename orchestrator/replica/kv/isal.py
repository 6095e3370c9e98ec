"""ctypes binding to ISA-L's erasure-code and CRC kernels (the one hand-written binding).

orchestrator.replica.kv.codec calls it. Why not a Python wrapper: pyeclib, zfec and the like
allocate and copy on every call and reach 0.1-0.4x of memcpy, while ISA-L's `ec_encode_data`
writing into reused buffers runs at up to about 2x memcpy (docs/kv-cache.md has the figures).
ctypes releases the GIL for each call, so encoding does not block other threads.

The library comes from the `pyeclib` wheel, which bundles ISA-L as
pyeclib.libs/libisal-pyeclib.so.2 (pyeclib itself is never imported), or from the system
(Debian's libisal2).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import zlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path


class IsalUnavailable(RuntimeError):
    """No ISA-L shared library could be loaded."""


def _candidates() -> list[str]:
    found: list[str] = []
    spec = importlib.util.find_spec("pyeclib")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            libs = Path(location).parent / "pyeclib.libs"
            found += sorted(str(p) for p in libs.glob("libisal*.so*"))
    system = ctypes.util.find_library("isal")
    if system:
        found.append(system)
    found.append("libisal.so.2")
    return found


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The ISA-L library with the prototypes we use declared (cached: loaded once). Raises
    IsalUnavailable, naming what was tried and how to install it, when none loads."""
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.ec_encode_data  # noqa: B018 - fail here if the symbol is missing
            break
        except (OSError, AttributeError) as err:
            errors.append(f"{path}: {err}")
    else:
        raise IsalUnavailable(
            "ISA-L not found: install the `pyeclib` wheel (pip install pyeclib, it bundles ISA-L) "
            "or Debian's libisal2; tried " + "; ".join(errors or ["nothing"])
        )
    u8p, vp, c_int = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int
    lib.gf_gen_cauchy1_matrix.argtypes = [u8p, c_int, c_int]
    lib.gf_gen_cauchy1_matrix.restype = None
    lib.gf_invert_matrix.argtypes = [u8p, u8p, c_int]
    lib.gf_invert_matrix.restype = c_int
    lib.ec_init_tables.argtypes = [c_int, c_int, u8p, u8p]
    lib.ec_init_tables.restype = None
    lib.ec_encode_data.argtypes = [c_int, c_int, c_int, u8p, vp, vp]
    lib.ec_encode_data.restype = None
    if hasattr(lib, "crc32_gzip_refl"):
        lib.crc32_gzip_refl.argtypes = [ctypes.c_uint32, vp, ctypes.c_uint64]
        lib.crc32_gzip_refl.restype = ctypes.c_uint32
    return lib


def crc32_function() -> Callable[[int, int, int], int]:
    """crc(value, address, length): zlib-compatible CRC-32 of memory at `address`.

    ISA-L's folded-CLMUL one (~12 GB/s here, 3x zlib) when the library has it. Raises
    IsalUnavailable as `load` does."""
    lib = load()
    if hasattr(lib, "crc32_gzip_refl"):
        return lib.crc32_gzip_refl
    return lambda value, address, length: zlib.crc32((ctypes.c_ubyte * length).from_address(address), value)


def crc32(address: int, length: int, value: int = 0) -> int:
    """CRC-32 of memory at `address` (see crc32_function)."""
    return crc32_function()(value, address, length)
