"""Format constants in one place: safetensors dtype names and their torch dtypes, the float dtypes' names, the order
safetensors writes dtypes in, sub-byte dtypes, checkpoint file names, and the engine's item record layout
(``MAX_NDIM``, ``ITEM_WIDTH``, the ``COL_*`` columns), exported by ``_core``.

Item array layout (``int64``, shape ``[n, ITEM_WIDTH]``; all numbers in elements), as ``execute.requests`` and
``execute.batch`` pack it::

    COL_FILE       index into the call's list of files
    COL_TENSOR     index of the tensor in that file's header (``SafetensorsFile.tensor_index``)
    COL_SRC_BASE   element index in the tensor of the box's first element
    COL_DEST       index into the call's list of destinations (address, nbytes, dtype code)
    COL_DST_BASE   element index in the destination buffer (destination dtype) of the first element
    COL_NDIM       number of dims used (0..MAX_NDIM)
    COL_LENGTHS .. +MAX_NDIM       box extent per dim
    COL_SRC_STRIDES .. +MAX_NDIM   source stride per dim
    COL_DST_STRIDES .. +MAX_NDIM   destination stride per dim (unused slots 0)
    COL_SCALE      0: a plain copy; k: dequantize with the call's scale record k-1 (``execute.batch``)

Sub-byte dtypes (``F4``, ``F6_E2M3``, ``F6_E3M2``, :data:`SUB_BYTE_BITS`) have no torch dtype: they are read into
``torch.uint8`` tensors holding the box's bytes.
"""

from __future__ import annotations

import torch

import hp_fastload._core as _core
from hp_fastload.errors import PlanError

MAX_NDIM: int = _core.MAX_NDIM


# The item layout, defined once in the engine (rust/python.rs) and exported by it.
ITEM_WIDTH: int = _core.ITEM_WIDTH


COL_FILE: int = _core.COL_FILE


COL_TENSOR: int = _core.COL_TENSOR


COL_SRC_BASE: int = _core.COL_SRC_BASE


COL_DEST: int = _core.COL_DEST


COL_DST_BASE: int = _core.COL_DST_BASE


COL_NDIM: int = _core.COL_NDIM


COL_LENGTHS: int = _core.COL_LENGTHS


COL_SRC_STRIDES: int = _core.COL_SRC_STRIDES


COL_DST_STRIDES: int = _core.COL_DST_STRIDES


COL_SCALE: int = _core.COL_SCALE


#: safetensors dtype name -> the engine's integer code.
DTYPE_CODES: dict[str, int] = dict(_core.DTYPE_CODES)


#: Bits per element of the dtypes smaller than a byte.
SUB_BYTE_BITS: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


_TORCH_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}


#: torch dtype -> safetensors dtype name (only the dtypes this torch build has).
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    getattr(torch, attr): name for attr, name in _TORCH_NAMES.items() if hasattr(torch, attr)
}


#: safetensors dtype name -> torch dtype (sub-byte dtypes are absent: see the module docstring).
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {name: dt for dt, name in TORCH_TO_SAFETENSORS.items()}


#: The float dtypes' safetensors names (what a quantized checkpoint's float tensors are stored as:
#: ``CheckpointIndex.keys_not_stored_as``).
FLOAT_NAMES: dict[torch.dtype, str] = {
    dtype: TORCH_TO_SAFETENSORS[dtype] for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


#: safetensors writes tensor data sorted by dtype, largest enum value first (then by name); this is its enum order
#: (safetensors' ``Dtype``), checked against safetensors' own files in tests/api/test_save.py.
SAFETENSORS_DTYPE_ORDER = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return TORCH_TO_SAFETENSORS[dtype]
    except KeyError:
        raise PlanError(f"torch dtype {dtype} has no safetensors equivalent") from None


INDEX_NAME = "model.safetensors.index.json"


SINGLE_NAME = "model.safetensors"
#: The model configuration next to the weights (architecture, sizes, ``quantization_config``).
CONFIG_NAME = "config.json"
