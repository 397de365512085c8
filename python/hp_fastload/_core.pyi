"""Stub of the Rust extension module ``hp_fastload._core`` (see rust/python.rs)."""

import os
from typing import Final, final

MAX_NDIM: Final[int]
ITEM_WIDTH: Final[int]
COL_FILE: Final[int]
COL_TENSOR: Final[int]
COL_SRC_BASE: Final[int]
COL_DEST: Final[int]
COL_DST_BASE: Final[int]
COL_NDIM: Final[int]
COL_LENGTHS: Final[int]
COL_SRC_STRIDES: Final[int]
COL_DST_STRIDES: Final[int]
COL_SCALE: Final[int]
SCALE_WIDTH: Final[int]
CAST_FLOATS: Final[tuple[str, ...]]
DTYPE_CODES: Final[dict[str, int]]
DEFAULT_THREADS: Final[int]
#: Whether this build has the object-storage backend (Rust feature ``s3``).
HAS_OBJECT_STORE: Final[bool]
#: The SIMD levels of the kernels, narrowest first (rust/simd.rs).
SIMD_LEVELS: Final[tuple[str, ...]]

__all__ = [
    "SafetensorsHeader",
    "HeaderEntry",
    "WeightMap",
    "execute",
    "key_templates",
    "companion_scan",
    "MAX_NDIM",
    "ITEM_WIDTH",
    "COL_FILE",
    "COL_TENSOR",
    "COL_SRC_BASE",
    "COL_DEST",
    "COL_DST_BASE",
    "COL_NDIM",
    "COL_LENGTHS",
    "COL_SRC_STRIDES",
    "COL_DST_STRIDES",
    "COL_SCALE",
    "SCALE_WIDTH",
    "CAST_FLOATS",
    "DTYPE_CODES",
    "DEFAULT_THREADS",
    "HAS_OBJECT_STORE",
    "SIMD_LEVELS",
    "simd_levels",
    "read_object",
    "list_objects",
    "object_identity",
    "object_counters",
]

@final
class HeaderEntry:
    """One tensor of a header (read-only): position in the header (an item's tensor field), safetensors dtype
    name, shape, and byte range ``[begin, end)`` relative to ``data_start``."""

    @property
    def position(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def begin(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """``end - begin``."""

@final
class SafetensorsHeader:
    """A parsed, validated safetensors header (the file is re-checked before every read)."""

    def __new__(cls, path: str | os.PathLike[str]) -> SafetensorsHeader: ...
    @staticmethod
    def open_objects(urls: list[str]) -> list[SafetensorsHeader]:
        """The headers of objects ``s3://bucket/key``, fetched together with ranged GETs (the 8-byte length, then
        the header); ``path`` is the URL. Reads through such a header fetch the needed ranges
        (``rust/objstore.rs``). ``ObjectStoreError`` naming bucket, key and HTTP status on failure."""
    @property
    def object_identity(self) -> tuple[str | None, int] | None:
        """``(ETag, size)`` of the object the header was fetched from; None for a file."""
    @property
    def path(self) -> str: ...
    @property
    def file_size(self) -> int: ...
    @property
    def data_start(self) -> int: ...
    @property
    def digest(self) -> int:
        """A 64-bit digest of the header bytes (length prefix and JSON): equal headers, equal digests."""
    def still_current(self) -> bool:
        """Whether the file at ``path`` still has this header: same device, inode, size, mtime and ctime, and
        the same header bytes (re-read). False on any error (the caller parses the file again)."""
    def metadata(self) -> dict[str, str] | None: ...
    def __len__(self) -> int: ...
    def entry_dict(self) -> dict[str, HeaderEntry]:
        """name -> its :class:`HeaderEntry`, in file order."""
    @staticmethod
    def natural_order(headers: list[SafetensorsHeader]) -> tuple[list[int], list[int]]:
        """Over the names of all ``headers`` taken in order (each in file order): ``(positions in natural order,
        positions of names left to Python: non-ASCII, control characters, numbers over 24 digits)``."""
    def release_map(self) -> None:
        """Drop the file map kept between reads (frees its page tables; its pages become evictable). A large
        map that no running read uses is unmapped on a short-lived background thread."""
    @staticmethod
    def facts(headers: list[SafetensorsHeader], names: list[str]) -> tuple[int, ...]:
        """A small int per name, equal for two names exactly when their dtypes and shapes are equal (ids are
        process-wide: they agree across headers), each name taken from the one of ``headers`` that has it
        (pass headers that share no name); ``KeyError(name)`` for the first name none has."""
    def names(self) -> list[str]:
        """The tensor names in file order."""
    def get(self, name: object) -> HeaderEntry | None:
        """The :class:`HeaderEntry` of the tensor called ``name``, built on each call, or None when there is
        none."""
    def __contains__(self, key: object, /) -> bool: ...
    def positions_not_of(self, dtype_names: list[str]) -> list[int]:
        """Positions (file order) of the tensors whose safetensors dtype name is not in ``dtype_names``."""

@final
class WeightMap:
    """The ``weight_map`` of a ``model.safetensors.index.json``: which file holds each tensor."""

    @staticmethod
    def parse(text: bytes) -> WeightMap | None:
        """The map of an index's bytes; None unless it is a JSON object whose ``weight_map`` is a non-empty
        object of strings (the caller reports what is wrong)."""
    def files(self) -> list[str]:
        """The file names it uses, sorted."""
    def __len__(self) -> int: ...
    def agrees(self, headers: list[SafetensorsHeader]) -> bool:
        """Whether it lists exactly the tensors of ``headers``, which are the files ``files()`` in order."""

def key_templates(names: list[str]) -> tuple[list[str], bytes, bytes, int] | None:
    """The key templates of ``names`` (``rust/keys.rs``): every numeric dotted component (1-18 digits, no
    leading zero) replaced by ``#``. ``(templates in order of first appearance, each name's template index as
    little-endian uint32, each name's numbers as ``width`` little-endian int64 padded with -1, width)``; None
    when a name contains ``#``."""

def companion_scan(
    names: list[str], suffixes: tuple[str, ...], marker: str | None = None
) -> tuple[list[str], bool, list[str], list[str]]:
    """One pass over ``names`` (``rust/keys.rs``): ``(hits, paired, values, scales)``, ``hits`` the names that
    end with one of ``suffixes``, in order; ``paired`` whether every hit ends with ``suffixes[0]`` and no name
    contains ``marker``; then (else empty) each hit whose stem (the name without ``suffixes[0]``) is a name,
    its stem's first occurrence in ``values`` and the hit in ``scales``, in the hits' order. Every string
    returned is one of ``names``' own objects. ``UnicodeEncodeError`` for a name that is not valid UTF-8."""

def execute(
    headers: list[SafetensorsHeader],
    dests: bytes,
    items: bytes,
    threads: int | None = None,
    backend: str = "auto",
    scales: bytes | None = None,
    direction: str = "read",
) -> dict[str, int | str]:
    """Read a batch of strided boxes into caller memory, with the GIL released.

    ``dests``: little-endian int64 triples (address, nbytes, dtype code); the memory must stay valid and
    untouched until the call returns. ``items``: int64 records of ``ITEM_WIDTH`` fields
    [file, tensor, src_base, dest, dst_base, ndim, lengths x MAX_NDIM, src_strides x MAX_NDIM,
    dst_strides x MAX_NDIM, scale], in elements. ``scale`` 0 copies (cast fused); ``k`` dequantizes with
    entry ``k - 1`` of ``scales``: int64 records of ``SCALE_WIDTH`` fields [file, tensor, ndim, shape x
    MAX_NDIM, block x MAX_NDIM] naming the scale tensor and the quantized tensor's shape and block shape; each
    element becomes ``f32(q) * f32(scale[block])``, rounded once (fp8 sources into F16/BF16/F32/F64; scales
    F32/BF16/F16/F8_E8M0, or U8 holding e8m0 exponents). ``backend``: "auto", "mmap" or "pread". Returns the stats
    bytes_copied, bytes_read_from_files, runs, spans, backend, threads (over objects, backend "direct" or
    "direct+mmap" when plain copies were written straight from the fetched bytes).

    ``direction="write"``: the same items the other way: each box is copied from its buffer into its
    tensor's bytes in the file (positioned writes; the files exist at their final size with their headers
    written; dtypes must be equal). ``backend`` is ignored; bytes_copied counts bytes written.
    """

def read_object(url: str) -> bytes | None:
    """The whole object at ``s3://bucket/key`` (an index, ``config.json``); None when it does not exist."""

def list_objects(url: str) -> list[str]:
    """The keys one level under ``s3://bucket/prefix/``, sorted."""

def object_identity(url: str) -> tuple[str | None, int]:
    """``(ETag, size)`` of the object at ``url`` now (one HEAD)."""

def object_counters(reset: bool = False) -> tuple[int, int, int]:
    """Process-wide ``(bytes fetched, GET requests, retries)`` of the object-storage backend; ``reset`` zeroes
    them after reading."""

def simd_levels() -> tuple[str, str, str | None]:
    """``(level in use, level this CPU supports, level HP_FASTLOAD_SIMD asks for or None)``; ``ValueError`` when
    ``HP_FASTLOAD_SIMD`` names no level."""
