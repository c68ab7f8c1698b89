"""Reads a `pytorch_model.bin` (torch.save's zip format, torch >= 1.6) into NumPy without torch.

The zip holds `<name>/data.pkl`, a pickle of the state dict whose tensors are
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` calls, and one raw file per
storage, `<name>/data/<key>`, that the pickle names by persistent id
`('storage', <dtype>Storage, key, location, numel)`. The unpickler here resolves only those
globals (the rebuild functions, the storage types, OrderedDict), so a file that asks for any
other callable is refused instead of executed. Sizes, strides and storage offsets are honoured
(views of one storage, as tied weights are, come out as separate arrays).

  load_state_dict(file)   {name: np.ndarray}
  RestrictedUnpickler     the base class: subclasses list the globals they allow
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from typing import Any, Callable

import ml_dtypes
import numpy as np

# torch's legacy storage classes -> NumPy dtypes (bfloat16 through ml_dtypes).
STORAGE_DTYPES = {
    "FloatStorage": np.dtype(np.float32), "DoubleStorage": np.dtype(np.float64),
    "HalfStorage": np.dtype(np.float16), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16), "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8), "BoolStorage": np.dtype(np.bool_),
}


class RestrictedUnpickler(pickle.Unpickler):
  """An unpickler that resolves only the (module, name) pairs in `allowed`; anything else is
  an UnpicklingError naming the global and the file."""

  allowed: dict[tuple[str, str], Any] = {}

  def __init__(self, data: bytes, source: str):
    super().__init__(io.BytesIO(data))
    self.source = source

  def find_class(self, module: str, name: str):
    try:
      return self.allowed[(module, name)]
    except KeyError:
      raise pickle.UnpicklingError(
          f"{self.source}: refusing to load global {module}.{name} (only tensors, storages "
          "and dicts are read)") from None


class _StorageType:
  """Stands for `torch.<X>Storage` in the pickle: only its dtype matters here. One instance
  per storage type serves every file, so a file must not change it (a BUILD on it would
  otherwise give every later load in the process another dtype)."""
  __slots__ = ("name", "dtype")

  def __init__(self, name: str):
    object.__setattr__(self, "name", name)
    object.__setattr__(self, "dtype", STORAGE_DTYPES[name])

  def __setattr__(self, name, value):
    raise pickle.UnpicklingError(f"torch.{self.name} cannot be changed by a checkpoint")

  def __setstate__(self, state):
    raise pickle.UnpicklingError(f"torch.{self.name} cannot be changed by a checkpoint")


def _rebuild_tensor(storage: np.ndarray, offset: int, size, stride, *_unused) -> np.ndarray:
  """`_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks[, meta])`:
  the strided view of the flat storage, copied out (element strides -> byte strides)."""
  size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
  if not size:
    return storage[offset:offset + 1].reshape(()).copy()
  if any(s == 0 for s in size):
    return np.zeros(size, storage.dtype)
  last = offset + sum((n - 1) * s for n, s in zip(size, stride))
  if offset < 0 or last >= storage.size or min(stride) < 0:
    raise pickle.UnpicklingError(f"tensor of size {size}, stride {stride} at offset {offset} "
                                 f"lies outside its storage of {storage.size} elements")
  item = storage.itemsize
  view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                         strides=tuple(s * item for s in stride), writeable=False)
  return np.array(view)


def _rebuild_parameter(data, requires_grad=False, hooks=None, *_unused):
  return data


def _rebuild_from_type_v2(func: Callable, _type, args, _state):
  return func(*args)


class _TorchUnpickler(RestrictedUnpickler):
  allowed = {
      ("collections", "OrderedDict"): collections.OrderedDict,
      ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
      ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
      ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
      ("torch.nn.parameter", "Parameter"): "Parameter",
      ("torch", "Tensor"): "Tensor",
      **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
  }

  def __init__(self, data: bytes, source: str, read_storage: Callable[[str, np.dtype], np.ndarray]):
    super().__init__(data, source)
    self.read_storage = read_storage
    self.storages: dict[str, np.ndarray] = {}

  def persistent_load(self, pid):
    if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)):
      raise pickle.UnpicklingError(f"{self.source}: unknown persistent id {pid!r}")
    storage_type, key = pid[1], str(pid[2])
    if key not in self.storages:
      self.storages[key] = self.read_storage(key, storage_type.dtype)
    return self.storages[key]


def load_state_dict(file: str, floats_as: np.dtype | None = None) -> dict[str, np.ndarray]:
  """The tensors of a zip-format torch checkpoint as NumPy arrays, by state-dict name.

  Args:
    file: a `pytorch_model.bin` written by torch.save (torch >= 1.6, the zip format).
    floats_as: convert every floating tensor (float16, bfloat16, float64, ...) to this dtype;
      None keeps the stored dtype (bfloat16 as ml_dtypes.bfloat16).
  Raises:
    ValueError for a legacy (non-zip) torch file, one without `data.pkl` or a damaged one;
    pickle.UnpicklingError for a global other than the torch tensor machinery (each naming
    the file).
  """
  if not zipfile.is_zipfile(file):
    raise ValueError(f"{file} is not a zip-format torch checkpoint (a legacy torch.save file, "
                     "torch < 1.6 or _use_new_zipfile_serialization=False): install torch to "
                     "read it, or re-save it with a current torch or as model.safetensors")
  try:
    with zipfile.ZipFile(file) as archive:
      pickles = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
      if len(pickles) != 1:
        raise ValueError(f"{file}: expected one data.pkl in the zip, found {len(pickles)}")
      prefix = pickles[0][:-len("data.pkl")]
      names = set(archive.namelist())
      big_endian = (prefix + "byteorder" in names
                    and archive.read(prefix + "byteorder").strip() == b"big")

      def read_storage(key: str, dtype: np.dtype) -> np.ndarray:
        raw = archive.read(f"{prefix}data/{key}")
        if len(raw) % dtype.itemsize:
          raise ValueError(f"storage {key} holds {len(raw)} bytes, not whole {dtype} elements")
        flat = np.frombuffer(raw, dtype.newbyteorder(">") if big_endian else dtype)
        return flat.astype(dtype) if big_endian else flat

      state = _TorchUnpickler(archive.read(pickles[0]), file, read_storage).load()
  except pickle.UnpicklingError as e:
    raise pickle.UnpicklingError(_naming(file, e)) from None
  except (KeyError, EOFError, zipfile.BadZipFile, ValueError, TypeError, IndexError,
          AttributeError) as e:   # a damaged or crafted file
    raise ValueError(_naming(file, e)) from None
  if not isinstance(state, dict):
    raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict")
  out = {}
  for name, value in state.items():
    if not isinstance(value, np.ndarray):
      continue                     # e.g. metadata entries; a state dict holds tensors
    if floats_as is not None and is_float(value.dtype):
      value = value.astype(floats_as)
    out[name] = value
  return out


def is_float(dtype) -> bool:
  """Whether `dtype` is a floating-point type, bfloat16 included (ml_dtypes' is no
  np.floating)."""
  return np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16


def _naming(file: str, error: Exception) -> str:
  """`error`'s message, starting with the file it is about."""
  message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
  return message if message.startswith(file) else f"{file}: {message}"
