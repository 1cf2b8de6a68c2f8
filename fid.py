"""
FID, sFID, Inception Score, Precision and Recall with the FID InceptionV3 network, in JAX, as OpenAI's
evaluator or pytorch-fid computes them.

The network is the TF 2015 Inception graph that Heusel et al. (2017, "GANs Trained by a Two
Time-Scale Update Rule Converge to a Local Nash Equilibrium") used for FID, as ported to PyTorch by
pytorch-fid (github.com/mseitzer/pytorch-fid, inception.py). We read pytorch-fid's weight file
directly, without torch, through a restricted unpickler that is also used to read DiT checkpoints
and other pickles. Images reach it by one of two protocols (PROTOCOLS): `adm`, the way OpenAI's
evaluator (openai/guided-diffusion, evaluations/evaluator.py) feeds the TF graph, which gave every
figure of the DiT paper, or `pytorch-fid`'s.

    python fid.py ref FOLDER_OR_NPZ OUT.npz       # a reference batch (OpenAI's evaluator's layout)
    python fid.py stats FOLDER_OR_NPZ OUT.npz     # FID statistics (mu, sigma), pytorch-fid's layout
    python fid.py fid samples.npz ref.npz         # FID, sFID, IS, Precision, Recall of DiT samples
                                                    (sample_ddp.py's arr_0 layout)
    python fid.py is samples.npz                  # Inception Score
    python fid.py bench                           # images/s of the feature extractor

From Python: `evaluate(images, ref)` for uint8 (N, H, W, 3) arrays, `image_statistics` for
folders and .npz files, `InceptionFeatures` to stream batches as they are generated.
"""

import argparse
import collections
import concurrent.futures
import functools
import hashlib
import http.client
import io
import math
import os
import pickle
import pickletools
import reprlib
import socket
import struct
import tempfile
import time
import types
import urllib.request
import warnings
import zipfile
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.special
from flax import nnx, traverse_util
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from PIL import Image
from tqdm import tqdm


#################################################################################
#                        Errors the user can fix, and the CLI                   #
#################################################################################

class InputError(ValueError):
    """What the user gave (a file, folder, path, option or the data in them) cannot be used.

    The message names it and says what to do. The command lines (run_cli) print that message
    alone, on one line and without a traceback; any other exception is a bug and keeps its
    traceback. A ValueError, so that code catching bad values catches these too.
    """


def run_cli(main, argv=None):
    """Run a command line's `main(argv)`. A failure on the user's input, an InputError or an
    OSError (a missing file, a full disk), ends the process with status 1 and one line on stderr,
    `error: <message>`."""
    try:
        return main(argv)
    except (InputError, OSError) as e:
        if isinstance(e, OSError) and e.filename is not None and e.strerror:
            message = f"{e.filename}: {e.strerror}"  # rather than "[Errno 2] ...: 'path'"
        else:
            message = str(e)
        # A message can quote another library's error text, which may span lines.
        raise SystemExit("error: " + " ".join(message.splitlines())) from None


#################################################################################
#                 Restricted Reader for PyTorch Files (no torch)                #
#################################################################################

class UnsafePickleError(InputError, pickle.UnpicklingError):
    """A pickle asked for a global (class or function) that is not on the allow list."""


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose only way to reach Python objects is an explicit table.

    A pickle can call any importable function (`os.system` included) by naming it; every such name
    goes through `find_class`, so refusing unknown names here means nothing from the file can run.
    """

    def __init__(self, fileobj, allowed, persistent_load, encoding):
        super().__init__(fileobj, encoding=encoding)
        self.allowed = allowed
        if persistent_load is not None:
            self.persistent_load = persistent_load

    def find_class(self, module, name):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"refused to load the global '{module}.{name}': it is not on the allow list. The "
                f"file may be malicious (a pickle can run arbitrary code through such names), or "
                f"it uses a feature this reader does not support. Nothing from the file was "
                f"run.") from None


class _Recorder:
    """A file as pickletools.genops reads it, keeping what was read. Reads go in pieces of at most
    1 MiB, so that a count in a pickle larger than its data allocates no more than the data."""

    def __init__(self, f):
        self.f, self.parts = f, []

    def read(self, n):
        pieces = []
        while n > 0 and (piece := self.f.read(min(n, 1 << 20))):
            pieces.append(piece)
            n -= len(piece)
        self.parts.append(b"".join(pieces))
        return self.parts[-1]

    def readline(self):
        self.parts.append(self.f.readline())
        return self.parts[-1]


def _read_pickle(fileobj):
    """The bytes of the next pickle in `fileobj`, up to its STOP, after checking its opcodes.

    The unpickler allocates what a pickle claims before reading it: a string's length (BINBYTES8
    and the like), or a memo as long as twice the largest index stored into it, zeroed, so that
    `LONG_BINPUT 2**30` alone takes 16 GiB. Here every count is read against the data that is
    really there, and a memo index may not exceed the opcodes before it (a pickler numbers its
    entries in order), so that no pickle makes the unpickler allocate much more than its own size.
    """
    recorder = _Recorder(fileobj)
    try:
        for seen, (opcode, arg, _) in enumerate(pickletools.genops(recorder)):
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg > seen:
                raise pickle.UnpicklingError(f"memo index {arg} after only {seen} opcodes: the "
                                             f"pickle is damaged or crafted")
    except ValueError as e:  # genops' word for truncated or unknown data
        raise pickle.UnpicklingError(f"damaged pickle ({e})") from None
    return b"".join(recorder.parts)


def safe_unpickle(fileobj, allowed, persistent_load=None, encoding="ASCII"):
    """Unpickle the next pickle in `fileobj`, resolving a global `module.name` only as
    `allowed[(module, name)]`.

    Anything else raises UnsafePickleError. `persistent_load` handles persistent ids (torch uses
    them for tensor storages). Pickles written by Python 2 (e.g. CIFAR-10's) need encoding="bytes"
    or "latin1". The pickle is read and checked first (_read_pickle), so that it cannot make the
    unpickler allocate more memory than it holds; a damaged one raises pickle.UnpicklingError.
    """
    raw = _read_pickle(fileobj)
    return _RestrictedUnpickler(io.BytesIO(raw), allowed, persistent_load, encoding).load()


# Storage classes as torch names them in a pickle -> element type of their raw bytes.
# bfloat16 has no numpy type; it is read as uint16 and widened to float32 (exact) in _storage_array.
_TORCH_STORAGE_DTYPES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _Record:
    """Base of the objects below, which a pickle can reach. The pickle BUILD instruction sets
    attributes on any object it holds (through __setstate__, or the instance dict), which could
    rewrite the shared storage types and corrupt every later load: refuse it."""
    __slots__ = ()

    def __setstate__(self, state):
        raise UnsafePickleError(f"the file tried to modify a {type(self).__name__.strip('_')}; a "
                                f"torch.save file never does this, so it may be malicious. Nothing "
                                f"from the file was run.")


class _StorageType(_Record):
    """Stand-in for a `torch.*Storage` class: only carries the element type."""
    __slots__ = ("name", "dtype")

    def __init__(self, name):
        self.name = name
        self.dtype = np.dtype(_TORCH_STORAGE_DTYPES[name])


class _Storage(_Record):
    """A tensor storage named in the pickle; its bytes are attached once they have been read."""
    __slots__ = ("storage_type", "numel", "data")

    def __init__(self, storage_type, numel):
        self.storage_type = storage_type
        self.numel = numel
        self.data = None  # 1-D numpy array of numel elements


class _Tensor(_Record):
    """A tensor as `torch._utils._rebuild_tensor_v2` describes it, turned into numpy by
    _materialize."""
    __slots__ = ("storage", "offset", "size", "stride")

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = (storage, offset, tuple(size),
                                                             tuple(stride))


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    """What torch calls to rebuild a tensor; here it only records where the tensor's elements
    are."""
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    return data  # an nn.Parameter is just its tensor here


# Everything a torch.save file of tensors, state dicts and official DiT training checkpoints
# ({"model", "ema", "opt", "args"}) names. argparse.Namespace becomes a SimpleNamespace: same
# attribute access, no argparse behaviour.
_TORCH_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): types.SimpleNamespace,
    **{("torch", name): _StorageType(name) for name in _TORCH_STORAGE_DTYPES},
}

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # first pickle of torch's legacy (non-zip) format


def _storage_id(path, saved_id, file_size):
    """Parse a persistent id ("storage", type, key, location, numel[, view]) and check it before
    anything is allocated for the storage: it cannot hold more bytes than the whole file."""
    if not (isinstance(saved_id, tuple) and len(saved_id) in (5, 6) and saved_id[0] == "storage"):
        kind = saved_id[0] if isinstance(saved_id, tuple) and saved_id else saved_id
        raise InputError(f"{path}: unsupported persistent id {reprlib.repr(kind)} (only tensor "
                         f"storages are read; save a state_dict rather than a whole module)")
    storage_type, key, numel = saved_id[1], str(saved_id[2]), saved_id[4]
    if len(saved_id) == 6 and saved_id[5] is not None:
        raise InputError(f"{path}: storage views (files from torch < 0.4) are not supported; load "
                         f"the file with torch and save its state_dict again")
    if not isinstance(storage_type, _StorageType) or not isinstance(numel, int) or numel < 0:
        raise InputError(f"{path}: malformed storage record {reprlib.repr(saved_id)}; the file is "
                         f"damaged or was not written by torch.save")
    nbytes = numel * storage_type.dtype.itemsize
    if nbytes > file_size:
        raise InputError(f"{path}: storage {reprlib.repr(key)} claims {numel} elements ({nbytes} "
                         f"bytes), more than the whole file ({file_size} bytes); the file is "
                         f"damaged or was not written by torch.save")
    return storage_type, key, numel


def _storage_array(path, storage, raw, little_endian):
    """Raw bytes -> 1-D numpy array of storage.numel elements (bfloat16 widened to float32)."""
    dtype = storage.storage_type.dtype.newbyteorder("<" if little_endian else ">")
    if len(raw) < storage.numel * dtype.itemsize:
        raise InputError(f"{path}: truncated tensor data ({len(raw)} bytes where "
                         f"{storage.numel * dtype.itemsize} were expected); download or save it "
                         f"again")
    data = np.frombuffer(raw, dtype, count=storage.numel).astype(dtype.newbyteorder("="))
    if storage.storage_type.name == "BFloat16Storage":  # bfloat16 is the top half of a float32
        data = (data.astype(np.uint32) << 16).view(np.float32)
    return data


def _materialize(path, obj, file_size):
    """Replace every _Tensor in a nested structure by a numpy array (a copy, never a view of the
    file).

    A file holds each storage once, but any number of tensors can view one storage, so a few bytes
    of pickle per tensor could ask for far more memory than the file holds. Only views of one
    storage (tied weights) make the tensors of a real file larger than the file, so the copies may
    add up to 8 times its size.
    """
    left = 8 * file_size

    def convert(obj):
        nonlocal left
        if isinstance(obj, _Tensor):
            data = obj.storage.data
            if data is None:
                raise InputError(f"{path}: a tensor refers to a storage whose data is missing; the "
                                 f"file is truncated or damaged, download or save it again")
            if any(s < 0 for s in obj.size) or any(s < 0 for s in obj.stride) or obj.offset < 0:
                raise InputError(f"{path}: tensor with negative size, stride or offset; the file "
                                 f"is damaged or was not written by torch.save")
            if 0 in obj.size:
                return np.zeros(obj.size, data.dtype)
            # A stride of 0 repeats elements; a few bytes could then ask for gigabytes. No state
            # dict needs it.
            if math.prod(obj.size) > data.size:
                raise InputError(f"{path}: tensor of size {obj.size} has more elements than its "
                                 f"storage ({data.size}); repeated (expanded) tensors are not "
                                 f"supported, save them with .clone()")
            # The last element a strided view touches must lie inside the storage, or as_strided
            # would read arbitrary memory.
            last = obj.offset + sum((n - 1) * s for n, s in zip(obj.size, obj.stride))
            if last >= data.size:
                raise InputError(f"{path}: tensor of size {obj.size} reaches element {last} of a "
                                 f"storage of {data.size} elements; the file is damaged")
            nbytes = math.prod(obj.size) * data.itemsize
            if nbytes > left:
                raise InputError(f"{path}: its tensors add up to more than 8 times the file's size "
                                 f"by viewing the same data over and over; files of model weights "
                                 f"never do that, so it is damaged or crafted")
            left -= nbytes
            view = np.lib.stride_tricks.as_strided(data[obj.offset:], obj.size,
                                                   [s * data.itemsize for s in obj.stride],
                                                   writeable=False)
            return np.array(view)
        if isinstance(obj, dict):
            return {k: convert(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(convert(v) for v in obj)
        if isinstance(obj, types.SimpleNamespace):
            return types.SimpleNamespace(**convert(vars(obj)))
        return obj

    return convert(obj)


def _load_torch_zip(path, archive, file_size):
    """torch.save's default format since 1.6: <top>/data.pkl plus one file <top>/data/<key> per
    storage."""
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise InputError(f"{path}: a zip file but not a torch.save file (no <folder>/data.pkl "
                         f"inside)")
    top = pickles[0][: -len("data.pkl")]
    left = file_size  # entries of a crafted archive can share bytes; all together fit in the file

    def read(info, what):
        nonlocal left
        # torch stores every member uncompressed. Checking sizes before reading means a crafted
        # archive can make us neither decompress gigabytes nor read one stretch many times over.
        if info.compress_type != zipfile.ZIP_STORED:
            raise InputError(f"{path}: {what} is compressed, which torch.save never does; the file "
                             f"was not written by torch.save")
        if max(info.file_size, info.compress_size) > left:
            raise InputError(f"{path}: {what} claims {info.file_size} bytes, more than the file "
                             f"holds ({file_size} bytes in all); the file is damaged")
        left -= info.compress_size
        return archive.read(info)

    # Files from before torch 1.10 have no byteorder record; they are little-endian.
    little_endian = (top + "byteorder" not in archive.namelist()
                     or read(archive.getinfo(top + "byteorder"), "the byteorder record") != b"big")
    storages = {}

    def persistent_load(saved_id):
        storage_type, key, numel = _storage_id(path, saved_id, file_size)
        if key not in storages:  # tensors that share a storage share the array
            storages[key] = storage = _Storage(storage_type, numel)
            try:
                info = archive.getinfo(f"{top}data/{key}")
            except KeyError:
                raise InputError(f"{path}: storage {key!r} is missing from the archive; the file "
                                 f"is truncated or damaged") from None
            nbytes = numel * storage_type.dtype.itemsize
            if info.file_size != nbytes:
                raise InputError(f"{path}: truncated or damaged file (storage {key!r} has "
                                 f"{info.file_size} bytes where {nbytes} were expected)")
            raw = read(info, f"storage {key!r}")
            storage.data = _storage_array(path, storage, raw, little_endian)
        return storages[key]

    raw = read(archive.getinfo(pickles[0]), pickles[0])
    return safe_unpickle(io.BytesIO(raw), _TORCH_ALLOWED, persistent_load)


def _load_torch_legacy(path, f, file_size):
    """torch's legacy format: magic, protocol and system-info pickles, the object pickle, the list
    of storage keys, then each storage as an int64 element count followed by its raw bytes."""
    def not_torch(why):
        return InputError(f"{path}: not a PyTorch file ({why}): neither a zip archive nor a legacy "
                          f"torch.save pickle; pass the file that torch.save wrote")

    try:
        magic = safe_unpickle(f, {})
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, IndexError, struct.error) as e:
        raise not_torch(f"{type(e).__name__}: {e}") from None
    if magic != _LEGACY_MAGIC:
        raise not_torch(f"it starts with {reprlib.repr(magic)}")
    protocol, sys_info = safe_unpickle(f, {}), safe_unpickle(f, {})
    if protocol != 1001 or not isinstance(sys_info, dict):
        raise InputError(f"{path}: unsupported legacy torch format (protocol "
                         f"{reprlib.repr(protocol)}); load it with torch and save it again")
    little_endian = sys_info.get("little_endian", True)
    storages = {}

    def persistent_load(saved_id):
        storage_type, key, numel = _storage_id(path, saved_id, file_size)
        return storages.setdefault(key, _Storage(storage_type, numel))

    obj = safe_unpickle(f, _TORCH_ALLOWED, persistent_load)
    keys = safe_unpickle(f, {})
    for key in keys:
        if key not in storages:
            raise InputError(f"{path}: the storage list names {reprlib.repr(key)}, which no tensor "
                             f"uses; the file is damaged")
        storage = storages[key]
        header = f.read(8)
        if len(header) < 8:
            raise InputError(f"{path}: truncated file (storage {key!r} is missing); download or "
                             f"save it again")
        count = struct.unpack("<q" if little_endian else ">q", header)[0]
        if count != storage.numel:
            raise InputError(f"{path}: storage {key!r} holds {count} elements where "
                             f"{storage.numel} were expected; the file is damaged")
        nbytes = count * storage.storage_type.dtype.itemsize
        if nbytes > file_size - f.tell():  # checked before reading, so a lie cannot exhaust memory
            raise InputError(f"{path}: truncated file (storage {key!r} needs {nbytes} more bytes); "
                             f"download or save it again")
        storage.data = _storage_array(path, storage, f.read(nbytes), little_endian)
    return obj


def load_torch(path):
    """Read a `torch.save` file without torch: nested dicts/lists with numpy arrays for the tensors.

    Reads both the zip format (torch >= 1.6 default, e.g. the official DiT checkpoints) and the
    legacy format (e.g. pytorch-fid's Inception weights). Only tensor rebuilding is allowed; any
    other global in the pickle raises UnsafePickleError before anything runs. bfloat16 tensors come
    back as float32. Every size the file claims is checked against the file's own size before
    memory is allocated for it; a file that fails a check raises InputError naming it.
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        try:
            if not file_size:
                raise InputError(f"{path}: the file is empty; download or save it again")
            if zipfile.is_zipfile(f):
                with zipfile.ZipFile(f) as archive:
                    obj = _load_torch_zip(path, archive, file_size)
            else:
                f.seek(0)
                if f.read(2) == b"PK":
                    raise InputError(f"{path}: a damaged or truncated zip archive; download or "
                                     f"save it again")
                f.seek(0)
                obj = _load_torch_legacy(path, f, file_size)
            return _materialize(path, obj, file_size)
        except UnsafePickleError as e:
            raise UnsafePickleError(f"{path}: {e}") from None
        except InputError:
            raise
        except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error, IndexError,
                TypeError, AttributeError, KeyError, ValueError, OverflowError, MemoryError,
                RecursionError, NotImplementedError, RuntimeError, OSError) as e:
            # Anything a damaged pickle or zip directory can raise: name the file, not the parser's
            # internals.
            raise InputError(f"{path}: damaged or truncated PyTorch file ({type(e).__name__}: "
                             f"{e}); download it again, or save it again with torch.save") from None


#################################################################################
#                         Bounded Reader for .npz Files                         #
#################################################################################

# Deflate cannot expand data more than 1032-fold (one 258-byte match per 2 bits).
_DEFLATE_MAX_RATIO = 1032


def read_npz(path, names=None):
    """{name: array} of an .npz file (numpy.savez's zip of .npy files): every array, or those of
    `names` that it holds (the others are left out, so that the caller can say what is missing).

    np.load allocates whatever an array's header claims before reading it, and reads zip entries
    that overlap; here every claim is checked first against the bytes that are really there, so
    that no file makes it allocate more than the file holds (1032 times that for
    np.savez_compressed). Object arrays, which need pickle, are refused. A file that fails a check
    raises InputError naming it.
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        try:
            with zipfile.ZipFile(f) as archive:
                members = {n[:-len(".npy")]: n for n in archive.namelist() if n.endswith(".npy")}
                wanted = members if names is None else [n for n in names if n in members]
                left = file_size  # entries of a crafted archive can share bytes; not the file's
                arrays = {}
                for name in wanted:
                    info = archive.getinfo(members[name])
                    if info.compress_size > left:
                        raise InputError(f"{path}: {name} claims {info.compress_size} bytes, "
                                         f"more than the file holds; the file is damaged, write "
                                         f"it again")
                    left -= info.compress_size
                    arrays[name] = _read_npy_member(path, archive, info, name)
                return arrays
        except InputError:
            raise
        except (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError, IndexError,
                struct.error, OverflowError, MemoryError, NotImplementedError, zlib.error) as e:
            raise InputError(f"{path}: not a readable .npz file ({type(e).__name__}: {e}); it is "
                             f"damaged or not numpy.savez's output, write it again") from None


def _read_npy_member(path, archive, info, name):
    """One .npy entry of an .npz, its header checked against the entry's size before the array is
    made."""
    if info.compress_type == zipfile.ZIP_STORED:
        bound = info.compress_size
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        bound = _DEFLATE_MAX_RATIO * info.compress_size
    else:
        raise InputError(f"{path}: {name} is compressed with zip method {info.compress_type}; "
                         f"numpy.savez and savez_compressed write stored or deflated entries, "
                         f"write it with them")
    if info.file_size > bound:
        raise InputError(f"{path}: {name} claims {info.file_size} bytes from {info.compress_size} "
                         f"stored; the file is damaged or crafted")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise InputError(f"{path}: {name} is in .npy format {version}, which is not read here; "
                             f"save it with numpy.savez")
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(f)
        if dtype.hasobject:
            raise InputError(f"{path}: {name} holds Python objects, which only pickle can read "
                             f"(and a pickle can run code); refused. Save plain numeric arrays")
        nbytes, stored = math.prod(shape) * dtype.itemsize, info.file_size - f.tell()
        if any(n < 0 for n in shape) or nbytes != stored:
            raise InputError(f"{path}: {name} claims shape {shape} of {dtype} ({nbytes} bytes) but "
                             f"holds {stored} bytes; the file is damaged or truncated, write it "
                             f"again")
        f.seek(0)  # read_array reads the header again, then the number of bytes checked here
        return np.lib.format.read_array(f, allow_pickle=False)


#################################################################################
#                      FID InceptionV3 (pytorch-fid's port)                     #
#################################################################################

def resize_matrix(in_size, out_size, half_pixel=True):
    """(out_size, in_size) matrix of bilinear resizing along one axis, without antialiasing.

    half_pixel=True is torch's `interpolate(align_corners=False)`, pytorch-fid's resize: output pixel
    i samples the input at src = (i + 0.5) * in/out - 0.5 (clamped below at 0). half_pixel=False is
    TensorFlow 1's `resize_bilinear` (align_corners=False), the ResizeBilinear node of the 2015
    Inception graph that OpenAI's evaluator feeds: src = i * in/out, so the grid is anchored at the
    top-left pixel and the last rows repeat the edge. Either way the two neighbours of src mix
    linearly, and when shrinking the pixels between the sampled pairs are skipped.
    """
    # Rounded as both libraries' CPU kernels round: a float32 scale, then src rounded once to
    # float32.
    scale = np.float64(np.float32(in_size) / np.float32(out_size))
    if half_pixel:
        src = np.maximum(((np.arange(out_size) + 0.5) * scale - 0.5).astype(np.float32), 0)
    else:
        src = (np.arange(out_size) * scale).astype(np.float32)
    lo = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = np.clip(src - lo, 0, 1).astype(np.float32)
    matrix = np.zeros((out_size, in_size), np.float32)
    rows = np.arange(out_size)
    np.add.at(matrix, (rows, lo), 1 - frac)  # add.at: lo == hi at the last input pixel
    np.add.at(matrix, (rows, hi), frac)
    return matrix


def resize_bilinear(x, height, width, half_pixel=True):
    """(B, H, W, C) -> (B, height, width, C) by bilinear interpolation without antialiasing, as
    torch (half_pixel=True) or TensorFlow 1 (half_pixel=False) resize: resize_matrix.

    Bilinear resizing is separable, so it is two small matrix products, with the libraries'
    interpolation weights (to float32 rounding) and fast on any device.
    """
    rows = resize_matrix(x.shape[1], height, half_pixel)
    cols = resize_matrix(x.shape[2], width, half_pixel)
    # HIGHEST keeps these products in true float32 where a GPU would otherwise use TF32.
    # (B, height, W, C)
    x = jnp.einsum("oh,bhwc->bowc", rows, x, precision=jax.lax.Precision.HIGHEST)
    # (B, height, width, C)
    return jnp.einsum("pw,bowc->bopc", cols, x, precision=jax.lax.Precision.HIGHEST)


# How images become Inception features, named by the code whose numbers each reproduces:
# - "adm": OpenAI's evaluator (openai/guided-diffusion, evaluations/evaluator.py), which computed
#   every figure of the DiT paper and of ADM: the graph's TF1 resize and normalisation, Inception
#   Score in splits of 5,000 samples.
# - "pytorch-fid": pytorch-fid's resize and normalisation, Inception Score in 10 splits.
# FID, sFID, Precision and Recall are computed the same way in both.
PROTOCOLS = ("adm", "pytorch-fid")
DEFAULT_PROTOCOL = "adm"
SPATIAL_CHANNELS = 7  # of mixed_6/conv, the sFID features
SPATIAL_DIM = 17 * 17 * SPATIAL_CHANNELS


class BasicConv2d(nnx.Module):
    """Convolution without bias, BatchNorm (eps 1e-3, the TF graph's) and ReLU: torchvision's
    BasicConv2d."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, *, rngs):
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        ph, pw = (padding, padding) if isinstance(padding, int) else padding
        self.conv = nnx.Conv(in_channels, out_channels, (kh, kw), stride,
                             padding=((ph, ph), (pw, pw)),
                             use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(out_channels, use_running_average=True, epsilon=1e-3, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.conv(x)))


def avg_pool_3x3(x):
    """3x3 average pooling, stride 1, padding 1, where the padding is not counted in the average.

    That is how the TF graph pools in the A, C and first E blocks (pytorch-fid's FIDInception*
    classes pass count_include_pad=False); torchvision's InceptionV3 counts the padding and differs
    at borders.
    """
    return nnx.avg_pool(x, (3, 3), (1, 1), padding=((1, 1), (1, 1)), count_include_pad=False)


def max_pool_3x3(x, stride, padding=0):
    """3x3 max pooling; padding (where used) never wins, as in torch's max_pool2d."""
    return nnx.max_pool(x, (3, 3), (stride, stride),
                        padding=((padding, padding), (padding, padding)))


class InceptionA(nnx.Module):
    """Mixed_5b/5c/5d: 1x1, 5x5, double 3x3 and pooled branches (35x35 grid)."""

    def __init__(self, in_channels, pool_features, *, rngs):
        self.branch1x1 = BasicConv2d(in_channels, 64, 1, rngs=rngs)
        self.branch5x5_1 = BasicConv2d(in_channels, 48, 1, rngs=rngs)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2, rngs=rngs)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, 1, rngs=rngs)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1, rngs=rngs)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1, rngs=rngs)
        self.branch_pool = BasicConv2d(in_channels, pool_features, 1, rngs=rngs)

    def __call__(self, x):
        branch5x5 = self.branch5x5_2(self.branch5x5_1(x))
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = self.branch_pool(avg_pool_3x3(x))
        return jnp.concatenate([self.branch1x1(x), branch5x5, branch3x3dbl, branch_pool], axis=-1)


class InceptionB(nnx.Module):
    """Mixed_6a: halves the grid (35 -> 17) with strided 3x3 convolutions beside a max pool."""

    def __init__(self, in_channels, *, rngs):
        self.branch3x3 = BasicConv2d(in_channels, 384, 3, stride=2, rngs=rngs)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, 1, rngs=rngs)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1, rngs=rngs)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2, rngs=rngs)

    def __call__(self, x):
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return jnp.concatenate([self.branch3x3(x), branch3x3dbl, max_pool_3x3(x, 2)], axis=-1)


class InceptionC(nnx.Module):
    """Mixed_6b..6e: 7x7 convolutions factorised into 1x7 and 7x1 (17x17 grid)."""

    def __init__(self, in_channels, channels_7x7, *, rngs):
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(in_channels, 192, 1, rngs=rngs)
        self.branch7x7_1 = BasicConv2d(in_channels, c7, 1, rngs=rngs)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3), rngs=rngs)
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0), rngs=rngs)
        self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, 1, rngs=rngs)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0), rngs=rngs)
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3), rngs=rngs)
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0), rngs=rngs)
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3), rngs=rngs)
        self.branch_pool = BasicConv2d(in_channels, 192, 1, rngs=rngs)

    def __call__(self, x):
        branch7x7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        branch7x7dbl = self.branch7x7dbl_1(x)
        for conv in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                     self.branch7x7dbl_5):
            branch7x7dbl = conv(branch7x7dbl)
        branch_pool = self.branch_pool(avg_pool_3x3(x))
        return jnp.concatenate([self.branch1x1(x), branch7x7, branch7x7dbl, branch_pool], axis=-1)


class InceptionD(nnx.Module):
    """Mixed_7a: halves the grid (17 -> 8) with strided convolutions beside a max pool."""

    def __init__(self, in_channels, *, rngs):
        self.branch3x3_1 = BasicConv2d(in_channels, 192, 1, rngs=rngs)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2, rngs=rngs)
        self.branch7x7x3_1 = BasicConv2d(in_channels, 192, 1, rngs=rngs)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3), rngs=rngs)
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0), rngs=rngs)
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2, rngs=rngs)

    def __call__(self, x):
        branch3x3 = self.branch3x3_2(self.branch3x3_1(x))
        branch7x7x3 = self.branch7x7x3_1(x)
        for conv in (self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4):
            branch7x7x3 = conv(branch7x7x3)
        return jnp.concatenate([branch3x3, branch7x7x3, max_pool_3x3(x, 2)], axis=-1)


class InceptionE(nnx.Module):
    """Mixed_7b/7c: 3x3 convolutions split into parallel 1x3 and 3x1 outputs (8x8 grid).

    The TF graph pools the last branch by averaging (padding not counted) in Mixed_7b but by max
    pooling in Mixed_7c, pytorch-fid's FIDInceptionE_1 and FIDInceptionE_2.
    """

    def __init__(self, in_channels, pool, *, rngs):
        self.pool = pool  # "avg" or "max"
        self.branch1x1 = BasicConv2d(in_channels, 320, 1, rngs=rngs)
        self.branch3x3_1 = BasicConv2d(in_channels, 384, 1, rngs=rngs)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1), rngs=rngs)
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0), rngs=rngs)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 448, 1, rngs=rngs)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1, rngs=rngs)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1), rngs=rngs)
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0), rngs=rngs)
        self.branch_pool = BasicConv2d(in_channels, 192, 1, rngs=rngs)

    def __call__(self, x):
        branch3x3 = self.branch3x3_1(x)
        branch3x3 = jnp.concatenate([self.branch3x3_2a(branch3x3), self.branch3x3_2b(branch3x3)],
                                    axis=-1)
        branch3x3dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        branch3x3dbl = jnp.concatenate([self.branch3x3dbl_3a(branch3x3dbl),
                                        self.branch3x3dbl_3b(branch3x3dbl)],
                                       axis=-1)
        pooled = avg_pool_3x3(x) if self.pool == "avg" else max_pool_3x3(x, 1, padding=1)
        branch_pool = self.branch_pool(pooled)
        return jnp.concatenate([self.branch1x1(x), branch3x3, branch3x3dbl, branch_pool], axis=-1)


class InceptionV3(nnx.Module):
    """The FID InceptionV3: uint8 images (B, H, W, 3) -> (pool features (B, 2048), logits
    (B, 1008), spatial features (B, 2023)).

    Same layers and names as pytorch-fid's `fid_inception_v3()`, so its weight file maps one to one.
    Inputs of any size are resized to 299x299 and scaled to about [-1, 1] as the protocol does it
    (PROTOCOLS). The 1008 logits (1000 ImageNet classes plus 8 unused, as in the TF graph) serve the
    Inception Score. The spatial features serve sFID (Nash et al. 2021, "Generating Images with
    Sparse Representations"): the first 7 channels of the graph's `mixed_6/conv`, the 1x1 branch of
    its seventh mixed block, which is Mixed_6d here (the graph numbers its blocks mixed, mixed_1, ...,
    mixed_10 for Mixed_5b ... Mixed_7c), flattened over the 17x17 grid as OpenAI's evaluator
    flattens them (height, width, channel).
    """

    def __init__(self, *, rngs):
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2, rngs=rngs)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3, rngs=rngs)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1, rngs=rngs)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1, rngs=rngs)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3, rngs=rngs)
        self.Mixed_5b = InceptionA(192, pool_features=32, rngs=rngs)
        self.Mixed_5c = InceptionA(256, pool_features=64, rngs=rngs)
        self.Mixed_5d = InceptionA(288, pool_features=64, rngs=rngs)
        self.Mixed_6a = InceptionB(288, rngs=rngs)
        self.Mixed_6b = InceptionC(768, channels_7x7=128, rngs=rngs)
        self.Mixed_6c = InceptionC(768, channels_7x7=160, rngs=rngs)
        self.Mixed_6d = InceptionC(768, channels_7x7=160, rngs=rngs)
        self.Mixed_6e = InceptionC(768, channels_7x7=192, rngs=rngs)
        self.Mixed_7a = InceptionD(768, rngs=rngs)
        self.Mixed_7b = InceptionE(1280, pool="avg", rngs=rngs)
        self.Mixed_7c = InceptionE(2048, pool="max", rngs=rngs)
        self.fc = nnx.Linear(2048, 1008, rngs=rngs)

    def __call__(self, images, protocol="pytorch-fid"):
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != jnp.uint8:
            raise ValueError(f"InceptionV3 expects uint8 RGB images of shape (B, H, W, 3), got "
                             f"{images.dtype} {tuple(images.shape)}; convert floats in [0, 1] with "
                             f"(x * 255).round().astype(uint8)")
        # Float32 products on every backend, as pytorch-fid's reference numbers were computed: XLA
        # otherwise multiplies float32 in TF32 on NVIDIA GPUs and in one bfloat16 pass on TPUs.
        with jax.default_matmul_precision("highest"):
            if protocol == "adm":
                # The graph's own input path, which OpenAI's evaluator feeds float 0..255 pixels:
                # TF1's bilinear resize, then (x - 128) / 128.
                x = resize_bilinear(images.astype(jnp.float32), 299, 299, half_pixel=False)
                x = (x - 128) / 128  # (B, 299, 299, 3)
            else:
                # pytorch-fid: uint8 / 255, torch's bilinear resize to 299x299, then [0, 1] ->
                # [-1, 1], in that order.
                x = resize_bilinear(images.astype(jnp.float32) / 255, 299, 299)
                x = 2 * x - 1  # (B, 299, 299, 3)
            x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))  # (B, 147, 147, 64)
            x = max_pool_3x3(x, 2)  # (B, 73, 73, 64)
            x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))  # (B, 71, 71, 192)
            x = max_pool_3x3(x, 2)  # (B, 35, 35, 192)
            x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))  # (B, 35, 35, 288)
            x = self.Mixed_6a(x)  # (B, 17, 17, 768)
            x = self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(x)))  # (B, 17, 17, 768)
            # Mixed_6d's output starts with its 1x1 branch: mixed_6/conv.
            spatial = x[..., :SPATIAL_CHANNELS].reshape(len(x), -1)  # (B, 17 * 17 * 7)
            x = self.Mixed_6e(x)  # (B, 17, 17, 768)
            x = self.Mixed_7a(x)  # (B, 8, 8, 1280)
            x = self.Mixed_7c(self.Mixed_7b(x))  # (B, 8, 8, 2048)
            pool = x.mean(axis=(1, 2))  # (B, 2048): pytorch-fid's "pool3" features
            return pool, self.fc(pool), spatial  # (B, 2048), (B, 1008), (B, 2023)


#################################################################################
#               Weights: pytorch-fid's file -> converted and cached              #
#################################################################################

FID_WEIGHTS_URL = ("https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
                   "pt_inception-2015-12-05-6726825d.pth")
FID_WEIGHTS_NAME = os.path.basename(FID_WEIGHTS_URL)
FID_WEIGHTS_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"


def default_cache_dir():
    """Where downloaded weights and datasets go: $DIT_CACHE, or ~/.cache/dit-jax."""
    return os.environ.get("DIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dit-jax")


def file_digest(path, algorithm="sha256"):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def download(url, path, digest=None, algorithm="sha256"):
    """Fetch url into path. The bytes go to a temporary file that takes the final name only once
    complete and, when a published digest is given, verified: an interrupted or damaged download
    never passes for the real file. Used for the Inception weights here and for the VAE and datasets
    in dit.py."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Named per host and process: hosts that share a cache folder can have equal process ids.
    tmp, hasher = f"{path}.part.{socket.gethostname()}.{os.getpid()}", hashlib.new(algorithm)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0) or None
            received = 0
            with tqdm(total=total, unit="B", unit_scale=True,
                      desc=f"downloading {os.path.basename(path)}") as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    hasher.update(chunk)
                    bar.update(len(chunk))
                    received += len(chunk)
            if total is not None and received != total:  # a connection that closed early
                raise http.client.IncompleteRead(b"", total - received)
    # URLError and socket timeouts are OSErrors too
    except (OSError, http.client.HTTPException) as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise FileNotFoundError(f"could not download {url} ({e!r}). Without network access, "
                                f"download it elsewhere and put it at {path}") from None
    if digest is not None and hasher.hexdigest() != digest:
        os.remove(tmp)
        raise InputError(f"the download of {url} is corrupted: its {algorithm} is "
                         f"{hasher.hexdigest()}, the published one is {digest}. Try again, or put "
                         f"a good copy at {path}")
    os.replace(tmp, path)


def _convert_torch_weights(state_dict, source):
    """pytorch-fid's state dict -> {"Mixed_5b/branch1x1/conv/kernel": array, ...} in the NNX model's
    layout."""
    if not (isinstance(state_dict, dict)
            and all(isinstance(v, np.ndarray) for v in state_dict.values())):
        raise InputError(f"{source}: not pytorch-fid's FID Inception weights (not a state dict of "
                         f"tensors). Pass {FID_WEIGHTS_NAME} from {FID_WEIGHTS_URL}")
    params = {}
    for key, value in state_dict.items():
        *module, name = key.split(".")
        if name == "num_batches_tracked":  # BatchNorm's training counter, unused at inference
            continue
        if value.ndim == 4:  # convolution (out, in, kh, kw) -> (kh, kw, in, out)
            name, value = "kernel", value.transpose(2, 3, 1, 0)
        elif value.ndim == 2:  # fc (out, in) -> (in, out)
            name, value = "kernel", value.T
        else:  # BatchNorm gamma, beta, running statistics; fc bias
            name = {"weight": "scale", "running_mean": "mean", "running_var": "var"}.get(name, name)
        params["/".join([*module, name])] = np.ascontiguousarray(value, np.float32)
    return params


def _torch_key(key):
    """"Mixed_5b/branch1x1/bn/mean" -> "Mixed_5b.branch1x1.bn.running_mean", the inverse of the
    renaming above."""
    *module, name = key.split("/")
    name = {"kernel": "weight", "scale": "weight", "mean": "running_mean",
            "var": "running_var"}.get(name, name)
    return ".".join([*module, name])


def _build_inception(params, source):
    """An InceptionV3 holding `params`, after checking that they are exactly the ones it needs."""
    # shapes only, nothing initialised
    abstract = nnx.eval_shape(lambda: InceptionV3(rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = {"/".join(map(str, path)): var.get_value().shape
                for path, var in nnx.to_flat_state(state)}
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    wrong = sorted(k for k in set(expected) & set(params) if params[k].shape != expected[k])
    if missing or unexpected or wrong:
        def show(keys):  # the first few, named as in the torch file
            return ", ".join(map(_torch_key, keys[:3])) + (f" and {len(keys) - 3} more"
                                                           if len(keys) > 3 else "")
        problems = [f"{label}: {show(keys)}" for label, keys in
                    (("missing", missing), ("unexpected", unexpected),
                     ("wrong shape", wrong)) if keys]
        raise InputError(f"{source}: not pytorch-fid's FID Inception weights "
                         f"({'; '.join(problems)}). Pass {FID_WEIGHTS_NAME} from {FID_WEIGHTS_URL}")
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(
        {tuple(key.split("/")): jnp.asarray(value) for key, value in params.items()}))
    return nnx.merge(graphdef, state)


def load_inception(path=None, cache_dir=None):
    """The FID InceptionV3 with pytorch-fid's weights, read from `path` (its legacy-format .pth
    file).

    Without a path the file is looked for in the cache directory ($DIT_CACHE or ~/.cache/dit-jax)
    and downloaded there when missing. A file under the official name must have the official sha256;
    another file (e.g. the random-weight test fixture) is accepted with a warning that its numbers
    are not comparable with published ones. The converted parameters are cached as an .npz named by
    the file's hash.
    """
    cache_dir = cache_dir or default_cache_dir()
    if path is None:
        path = os.path.join(cache_dir, FID_WEIGHTS_NAME)
        if not os.path.exists(path):
            download(FID_WEIGHTS_URL, path, FID_WEIGHTS_SHA256)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"FID Inception weights {path} not found; pass pytorch-fid's "
                                f"{FID_WEIGHTS_NAME} (from {FID_WEIGHTS_URL}) or leave the path "
                                f"out to download it")
    digest = file_digest(path)
    if digest != FID_WEIGHTS_SHA256 and os.path.basename(path) == FID_WEIGHTS_NAME:
        raise InputError(f"{path}: sha256 {digest} differs from the official "
                         f"{FID_WEIGHTS_SHA256}; the file is damaged or incomplete. Delete it "
                         f"and run again to download it afresh")
    converted = os.path.join(cache_dir, f"inception-{digest[:16]}.npz")
    if os.path.exists(converted):
        inception = _build_inception(read_npz(converted), path)
    else:
        params = _convert_torch_weights(load_torch(path), path)
        inception = _build_inception(params, path)  # checks the weights before they are cached
        try:  # write then rename, so that an interrupted run never leaves half a cache file
            os.makedirs(cache_dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".npz", delete=False) as f:
                np.savez(f, **params)
            os.replace(f.name, converted)
        except OSError as e:
            warnings.warn(f"could not cache the converted Inception weights in {cache_dir} ({e}); "
                          f"they will be converted again next time")
    if digest != FID_WEIGHTS_SHA256:  # only once the file has loaded: a failed run ends in one line
        warnings.warn(f"{path} is not pytorch-fid's official Inception weights (sha256 "
                      f"{digest[:12]}...): FID and Inception Score computed with it are not "
                      f"comparable with published numbers")
    return inception


#################################################################################
#               Statistics, Frechet distance and Inception Score                #
#################################################################################

class FeatureStats:
    """Running mean and covariance of feature vectors in float64, without keeping the features.

    Batches are merged with the pairwise update of Chan, Golub & LeVeque (1979): each batch's own
    mean and centred scatter matrix are combined with the running ones, which stays accurate where
    the naive sum of x x^T minus N mu mu^T would cancel. The covariance is np.cov's
    (divided by N - 1).
    """

    def __init__(self, dim):
        self.count = 0
        self.mean = np.zeros(dim)  # (D,)
        self.scatter = np.zeros((dim, dim))  # (D, D): sum of (x - mean)(x - mean)^T

    def merge(self, count, mean, scatter):
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.scatter += scatter + np.outer(delta, delta) * (self.count * count / total)
        self.mean += delta * (count / total)
        self.count = total

    def update(self, features):
        """Add a batch of features (B, D)."""
        features = np.asarray(features, np.float64)
        if not len(features):  # a process whose share ran out before the others'
            return
        mean = features.mean(axis=0)
        centred = features - mean
        self.merge(len(features), mean, centred.T @ centred)

    def mu_sigma(self):
        """(mu (D,), sigma (D, D)); warns when too few samples give a singular covariance."""
        if self.count < 2:
            raise InputError(f"a covariance needs at least 2 images, got {self.count}; give more "
                             f"images")
        dim = len(self.mean)
        if self.count <= dim:
            warnings.warn(f"only {self.count} images for {dim}-d features: the covariance has rank "
                          f"at most {self.count - 1} < {dim}, so it is singular and FID comes out "
                          f"biased upwards and not comparable with others'. Use more than {dim} "
                          f"images (FID-10K uses 10,000)")
        return self.mean.copy(), self.scatter / (self.count - 1)


def frechet_distance(mu1, sigma1, mu2, sigma2, eps=1e-6):
    """||mu1 - mu2||^2 + Tr(sigma1 + sigma2 - 2 sqrt(sigma1 sigma2)), as pytorch-fid computes it.

    The Frechet (2-Wasserstein) distance between two Gaussians (Dowson & Landau 1982). When the
    matrix square root is not finite (a singular product), eps is added to both diagonals; a complex
    root whose diagonal has a non-negligible imaginary part means the inputs are not valid
    covariances.
    """
    mu1, mu2 = (np.atleast_1d(np.asarray(mu1, np.float64)),
                np.atleast_1d(np.asarray(mu2, np.float64)))
    sigma1, sigma2 = (np.atleast_2d(np.asarray(sigma1, np.float64)),
                      np.atleast_2d(np.asarray(sigma2, np.float64)))
    if (mu1.shape != mu2.shape or sigma1.shape != sigma2.shape
            or sigma1.shape != (len(mu1), len(mu1))):
        raise InputError(f"statistics do not match: mu {mu1.shape} vs {mu2.shape}, sigma "
                         f"{sigma1.shape} vs {sigma2.shape}; both must come from the same features "
                         f"(2048-d pool3 for FID)")
    diff = mu1 - mu2
    covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        warnings.warn(f"singular product sigma1 sigma2 (too few images?): adding {eps} to the "
                      f"diagonals")
        offset = np.eye(len(mu1)) * eps
        covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise InputError(f"imaginary component {np.max(np.abs(covmean.imag))} in "
                             f"sqrt(sigma1 sigma2): the statistics are not valid covariance "
                             f"matrices; compute them again with `python fid.py stats`")
        covmean = covmean.real
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def inception_score(logits, splits=10, split_size=None):
    """(mean, std) over parts of exp(E_x KL(p(y|x) || p(y))) (Salimans et al. 2016).

    p(y|x) is the softmax of the 1008 logits; p(y) is the mean over each part. The parts are
    `splits` near-equal ones (pytorch-fid's protocol, 10), or with `split_size` consecutive runs of
    that many samples, the last one shorter, as OpenAI's evaluator splits them (5,000: 2 parts of
    FID-10K's samples, 10 of FID-50K's). Pass the logits without the bias of the last layer
    (pool @ W), as the original TF code and OpenAI's evaluator compute them:
    InceptionFeatures.result()["score_logits"].
    """
    logits = np.asarray(logits, np.float64)
    if split_size is None and len(logits) < splits:
        raise InputError(f"Inception Score with {splits} splits needs at least {splits} images, "
                         f"got {len(logits)}; give more images")
    if not len(logits):
        raise InputError("Inception Score of no images; give some")
    log_p = logits - scipy.special.logsumexp(logits, axis=1, keepdims=True)  # (N, 1008): log p(y|x)
    parts = (np.array_split(log_p, splits) if split_size is None
             else [log_p[i:i + split_size] for i in range(0, len(log_p), split_size)])
    scores = []
    for part in parts:
        log_marginal = np.log(np.exp(part).mean(axis=0))  # (1008,): log p(y) over this part
        kl = (np.exp(part) * (part - log_marginal)).sum(axis=1)  # (n,)
        scores.append(np.exp(kl.mean()))
    return float(np.mean(scores)), float(np.std(scores))


#################################################################################
#          Precision and Recall (Kynkaanniemi et al. 2019), on the device        #
#################################################################################

# Rows and columns of one block of distances. OpenAI's evaluator (ManifoldEstimator) works in blocks
# of 10,000 x 10,000 and decides per block whether float16 distances are finite or must be
# recomputed in float32, so the same blocks give the same distances.
PR_BLOCK = 10_000
PR_NEIGHBOURS = 3  # the k of the k-NN radii, the evaluator's


def _squared_distances(u, v, dtype):
    """(R, C) squared Euclidean distances |u|^2 - 2 u.v + |v|^2 (clamped at 0) of u (R, D) and
    v (C, D), every step rounded to `dtype` as the evaluator's TensorFlow graph rounds it; sums and
    products accumulate in float32, as on the accelerators the evaluator ran on."""
    u, v = u.astype(dtype), v.astype(dtype)
    norm_u = jnp.sum(jnp.square(u), axis=1, dtype=jnp.float32).astype(dtype)  # (R,)
    norm_v = jnp.sum(jnp.square(v), axis=1, dtype=jnp.float32).astype(dtype)  # (C,)
    dot = jnp.dot(u, v.T, preferred_element_type=jnp.float32,
                  precision=jax.lax.Precision.HIGHEST).astype(dtype)  # (R, C)
    return jnp.maximum(norm_u[:, None] - 2 * dot + norm_v[None, :], 0)


@jax.jit
def _block_distances(u, v):
    """The evaluator's DistanceBlock: float16 distances where all of the block's are finite, else
    the block again in float32. (R, C) float32."""
    half = _squared_distances(u, v, jnp.float16)
    return jax.lax.cond(jnp.isfinite(half).all(), lambda: half.astype(jnp.float32),
                        lambda: _squared_distances(u, v, jnp.float32))


@functools.partial(jax.jit, static_argnums=2)
def _nearest(nearest, block, k):
    """The k + 1 smallest squared distances of each row (R, k + 1), ascending, of the running ones
    (R, k + 1) and a new block (R, C)."""
    return -jax.lax.top_k(-jnp.concatenate([nearest, block], axis=1), k + 1)[0]


def manifold_radii(features, k=PR_NEIGHBOURS):
    """(N,) squared distance of each feature vector (N, D) to its k-th nearest neighbour in the set,
    the radius of its ball in the estimated manifold. The vector itself counts as its nearest (at
    distance 0), as in the evaluator. Rows go PR_BLOCK at a time and keep only their k + 1 nearest,
    so the N x N distances are never held at once."""
    features = jnp.asarray(features, jnp.float32)
    radii = []
    for i in range(0, len(features), PR_BLOCK):
        rows = features[i:i + PR_BLOCK]
        nearest = jnp.full((len(rows), k + 1), jnp.inf, jnp.float32)
        for j in range(0, len(features), PR_BLOCK):
            nearest = _nearest(nearest, _block_distances(rows, features[j:j + PR_BLOCK]), k)
        radii.append(nearest[:, k])
    return jnp.concatenate(radii)


@jax.jit
def _inside(u, v, radii_u, radii_v):
    """For blocks u (R, D) and v (C, D): whether each u lies in some ball of v (R,), and each v in
    some ball of u (C,)."""
    distances = _block_distances(u, v)  # (R, C)
    return ((distances <= radii_v[None, :]).any(axis=1),
            (distances <= radii_u[:, None]).any(axis=0))


def precision_recall(ref_features, features, k=PR_NEIGHBOURS):
    """Improved Precision and Recall (Kynkaanniemi et al. 2019) as OpenAI's evaluator computes them
    from pool features (N, 2048): precision is the fraction of samples inside the reference
    manifold (some reference ball of radius the distance to its k-th neighbour), recall the
    fraction of references inside the samples' manifold."""
    if min(len(ref_features), len(features)) <= k:
        raise InputError(f"Precision and Recall need more than {k} images in each set, got "
                         f"{len(ref_features)} references and {len(features)} samples")
    ref_features = jnp.asarray(ref_features, jnp.float32)
    features = jnp.asarray(features, jnp.float32)
    ref_radii, radii = manifold_radii(ref_features, k), manifold_radii(features, k)
    ref_inside = np.zeros(len(ref_features), bool)
    inside = np.zeros(len(features), bool)
    for i in range(0, len(ref_features), PR_BLOCK):
        for j in range(0, len(features), PR_BLOCK):
            ref_in, sample_in = _inside(ref_features[i:i + PR_BLOCK], features[j:j + PR_BLOCK],
                                        ref_radii[i:i + PR_BLOCK], radii[j:j + PR_BLOCK])
            ref_inside[i:i + PR_BLOCK] |= np.asarray(ref_in)
            inside[j:j + PR_BLOCK] |= np.asarray(sample_in)
    return float(inside.mean()), float(ref_inside.mean())


#################################################################################
#                     Reference statistics and reference batches                  #
#################################################################################

def save_statistics(path, mu, sigma, protocol="pytorch-fid"):
    """Write FID statistics as pytorch-fid does: an .npz with `mu` (D,) and `sigma` (D, D), and the
    `protocol` that made them, which pytorch-fid's reader ignores."""
    np.savez(path, mu=np.asarray(mu, np.float64), sigma=np.asarray(sigma, np.float64),
             protocol=np.array(protocol))


def load_statistics(path):
    """(mu, sigma) from a pytorch-fid .npz or an OpenAI reference batch (which keeps `arr_0` beside
    them)."""
    stats = read_npz(path, ["mu", "sigma"])
    if len(stats) < 2:
        raise InputError(f"{path} has no `mu` and `sigma`, so it is not FID statistics; for an "
                         f".npz of images (`arr_0`) compute them with `python fid.py stats {path} "
                         f"OUT.npz`")
    mu, sigma = stats["mu"], stats["sigma"]
    if (mu.ndim != 1 or sigma.shape != (len(mu), len(mu))
            or mu.dtype.kind not in "fiu" or sigma.dtype.kind not in "fiu"):
        raise InputError(f"{path}: mu {mu.dtype} {mu.shape} and sigma {sigma.dtype} {sigma.shape} "
                         f"are not a real (D,) mean and (D, D) covariance; compute them with "
                         f"`python fid.py stats`")
    return mu.astype(np.float64), sigma.astype(np.float64)


REF_PR_IMAGES = 10_000  # OpenAI's reference batches keep 10,000 images for Precision and Recall


def file_protocol(arrays):
    """The protocol of a statistics or reference file's arrays: its `protocol` if it names one
    (files that fid.py writes), else "adm" for OpenAI's reference batches (with sFID's mu_s) and
    "pytorch-fid" for pytorch-fid's statistics (mu and sigma only)."""
    if "protocol" in arrays:
        return str(arrays["protocol"])
    return "adm" if "mu_s" in arrays else "pytorch-fid"


def evenly_spaced(count, k):
    """Indices of min(k, count) of `count` items, evenly spaced from the first to the last: the
    images of a reference whose pool features are kept."""
    return np.linspace(0, count - 1, min(k, count)).round().astype(int)


def save_reference(path, out):
    """A reference batch in OpenAI's evaluator's layout, from InceptionFeatures.result() (or the
    same keys): `mu`, `sigma` (pool features, FID) and `mu_s`, `sigma_s` (spatial features, sFID),
    in float64; in place of its `arr_0` images, `pool`, the float32 pool features of some of them
    (REF_PR_IMAGES, evenly_spaced, as OpenAI keeps 10,000 images), which are what Precision and
    Recall use of the images; and `protocol`."""
    np.savez(path, mu=out["mu"], sigma=out["sigma"], mu_s=out["mu_s"], sigma_s=out["sigma_s"],
             pool=np.asarray(out["pool"], np.float32), protocol=np.array(out["protocol"]))


def load_reference(path):
    """The reference statistics and features of an .npz: {"protocol", "mu", "sigma"} and, where the
    file has them, "mu_s" and "sigma_s" (sFID), "pool" (Precision and Recall) and "images" (the
    `arr_0` of OpenAI's reference batches, such as VIRTUAL_imagenet256_labeled.npz, whose pool
    features evaluate() computes when it needs them)."""
    mu, sigma = load_statistics(path)
    arrays = read_npz(path, ["mu_s", "sigma_s", "pool", "protocol"])
    ref = {"protocol": file_protocol(arrays), "mu": mu, "sigma": sigma}
    if ref["protocol"] not in PROTOCOLS:
        raise InputError(f"{path}: unknown protocol {ref['protocol']!r}; expected one of "
                         f"{', '.join(PROTOCOLS)}")
    if "mu_s" in arrays:
        mu_s, sigma_s = arrays["mu_s"], arrays.get("sigma_s")
        if (sigma_s is None or mu_s.shape != (SPATIAL_DIM,)
                or sigma_s.shape != (SPATIAL_DIM, SPATIAL_DIM)):
            raise InputError(f"{path}: mu_s {mu_s.shape} and sigma_s "
                             f"{None if sigma_s is None else sigma_s.shape} are not sFID "
                             f"statistics ({SPATIAL_DIM},) and ({SPATIAL_DIM}, {SPATIAL_DIM}); "
                             f"make the reference with `python fid.py ref`")
        ref["mu_s"], ref["sigma_s"] = mu_s.astype(np.float64), sigma_s.astype(np.float64)
    if "pool" in arrays:
        pool = arrays["pool"]
        if pool.ndim != 2 or pool.shape[1] != len(mu) or pool.dtype.kind != "f":
            raise InputError(f"{path}: pool {pool.dtype} {pool.shape} is not (N, {len(mu)}) "
                             f"features; make the reference with `python fid.py ref`")
        ref["pool"] = pool.astype(np.float32)
    elif ref["protocol"] == "adm":
        with zipfile.ZipFile(path) as archive:  # a valid .npz: load_statistics has read it
            if "arr_0.npy" in archive.namelist():
                ref["images"] = load_images(path)
    return ref


#################################################################################
#           Feature extraction over all devices and hosts, image sources        #
#################################################################################

def _allgather(x):
    """Stack a numpy array from every process: (P, *x.shape). 64-bit values travel as pairs of
    uint32, so they stay exact even though JAX (without x64) would narrow them to 32 bits."""
    x = np.ascontiguousarray(x)
    if jax.process_count() == 1:
        return x[None]
    gathered = multihost_utils.process_allgather(x.view(np.uint32) if x.dtype.itemsize == 8 else x)
    return np.asarray(gathered).view(x.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _inception_forward(graphdef, protocol, state, images):
    """Compiled once per (protocol, batch, image shape) and shared by every InceptionFeatures (e.g.
    repeated evaluations)."""
    return nnx.merge(graphdef, state)(images, protocol)


class InceptionFeatures:
    """Streams uint8 images through the InceptionV3 as `protocol` feeds it: the statistics of the
    pool and spatial features in float64, all pool features (for Precision and Recall) and all
    logits.

    Each call to `update` runs jit-compiled batches sharded over every device (a 1-D mesh), the last
    batch padded and the padding dropped. Under `jax.distributed` every process passes its own
    images and calls `update` the same number of times (it is a collective); `result` combines all
    processes.
    """

    def __init__(self, inception, batch_size=128, progress=True, protocol=DEFAULT_PROTOCOL):
        if protocol not in PROTOCOLS:
            raise InputError(f"unknown protocol {protocol!r}; expected one of "
                             f"{', '.join(PROTOCOLS)}")
        self.mesh = jax.make_mesh((jax.device_count(),), ("batch",))
        self.per_device = batch_size
        graphdef, state = nnx.split(inception)
        # weights replicated on every device
        self.state = jax.device_put(state, NamedSharding(self.mesh, P()))
        # (state, images) -> (pool, logits, spatial)
        self.forward = functools.partial(_inception_forward, graphdef, protocol)
        self.protocol = protocol
        self.stats, self.spatial_stats = FeatureStats(2048), FeatureStats(SPATIAL_DIM)
        self.pool, self.logits = [], []  # this process's (n, 2048) and (n, 1008) blocks
        self.fc_bias = np.asarray(inception.fc.bias[...])
        self.image_shape = None
        self.progress = progress and jax.process_index() == 0

    def _to_host(self, outputs, valid):
        pool, logits, spatial = multihost_utils.global_array_to_host_local_array(
            outputs, self.mesh, P("batch"))
        self.pool.append(np.asarray(pool)[:valid])
        self.stats.update(self.pool[-1])
        self.spatial_stats.update(np.asarray(spatial)[:valid])
        self.logits.append(np.asarray(logits)[:valid])

    def update(self, images, bar=None):
        """Add this process's images: uint8 (N, H, W, 3), N may be 0; all calls must share H and
        W."""
        images = np.asarray(images)
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise InputError(f"expected uint8 RGB images of shape (N, H, W, 3), got {images.dtype} "
                             f"{images.shape}; convert floats in [0, 1] with "
                             f"(x * 255).round().clip(0, 255).astype(np.uint8)")
        # Every process must run the same number of steps on the same shapes, so agree on both
        # first.
        # (P, 3): N, H, W per process
        sizes = _allgather(np.array([len(images), *images.shape[1:3]], np.int64))
        shapes = {tuple(size[1:]) for size in sizes if size[0] > 0}
        if self.image_shape is not None:
            shapes.add(self.image_shape)
        if len(shapes) > 1:
            raise InputError(f"images of different sizes {sorted(shapes)}: FID needs images of one "
                             f"size; resize or crop them all to the same height and width first")
        most = sizes[:, 0].max()
        if most == 0:
            return
        self.image_shape = shapes.pop()
        local_devices = jax.local_device_count()
        # A batch no larger than needed (small evaluations do not compute padding), a multiple of
        # the devices.
        batch = min(self.per_device, -(-most // local_devices)) * local_devices
        steps = -(-most // batch)
        pending = None
        for step in range(steps):
            chunk = images[step * batch:(step + 1) * batch]
            padded = np.zeros((batch, *self.image_shape, 3), np.uint8)  # (batch, H, W, 3)
            padded[:len(chunk)] = chunk
            inputs = multihost_utils.host_local_array_to_global_array(padded, self.mesh, P("batch"))
            outputs = self.forward(self.state, inputs)  # dispatched asynchronously ...
            if pending is not None:
                self._to_host(*pending)  # ... so the host works on the previous batch meanwhile
            pending = (outputs, len(chunk))
            if bar is not None:
                bar.update(len(chunk))
        self._to_host(*pending)

    def result(self):
        """{"mu", "sigma", "mu_s", "sigma_s", "count", "pool", "logits", "score_logits", "protocol"}
        over the images of all processes: "mu_s" and "sigma_s" are the spatial features' (sFID),
        "pool" all pool features (N, 2048), "logits" pytorch-fid's (the last layer's output),
        "score_logits" the same without its bias, for the Inception Score."""
        moments = []
        for local in (self.stats, self.spatial_stats):
            stats, dim = FeatureStats(len(local.mean)), len(local.mean)
            gathered = _allgather(np.concatenate([[local.count], local.mean,
                                                  local.scatter.ravel()]))
            for row in gathered:  # (1 + D + D*D,) per process
                stats.merge(int(row[0]), row[1:dim + 1], row[dim + 1:].reshape(dim, dim))
            moments.append(stats.mu_sigma())
        (mu, sigma), (mu_s, sigma_s) = moments
        logits = _gather_rows(self.logits, 1008)
        return {"mu": mu, "sigma": sigma, "mu_s": mu_s, "sigma_s": sigma_s,
                "count": len(logits), "pool": _gather_rows(self.pool, 2048), "logits": logits,
                "score_logits": logits - self.fc_bias, "protocol": self.protocol}


def _gather_rows(blocks, dim):
    """This process's float32 (n, dim) blocks -> the rows of all processes, in process order."""
    rows = np.concatenate(blocks) if blocks else np.zeros((0, dim), np.float32)
    if jax.process_count() == 1:
        return rows
    # pad to a common length to gather, then drop the padding
    counts = _allgather(np.array([len(rows)]))[:, 0]
    padded = np.zeros((counts.max(), dim), np.float32)
    padded[:len(rows)] = rows
    return np.concatenate([part[:n] for part, n in zip(_allgather(padded), counts)])


IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpg", ".jpeg", ".pgm", ".png", ".ppm", ".tif", ".tiff",
                    ".webp")


class ImageFolder:
    """The image files under a folder (recursively, sorted) as a sequence: folder[i:j] -> uint8
    (n, H, W, 3).

    Files are decoded on a few threads (PIL releases the GIL); grayscale and RGBA become RGB as in
    pytorch-fid.
    """

    def __init__(self, root):
        self.paths = sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files
                            if f.lower().endswith(IMAGE_EXTENSIONS))
        if not self.paths:
            raise InputError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}; give a "
                             f"folder that holds some")
        self.shape = self._read(self.paths[0]).shape
        self.pool = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1))

    @staticmethod
    def _read(path):
        try:
            with Image.open(path) as image:
                return np.asarray(image.convert("RGB"))
        # PIL raises these on malformed files, and its messages do not always name the file.
        except (OSError, ValueError, SyntaxError, EOFError, struct.error,
                Image.DecompressionBombError) as e:
            raise InputError(f"{path} is not a readable image ({type(e).__name__}: {e}); remove or "
                             f"replace it") from None

    def _read_checked(self, path):
        image = self._read(path)
        if image.shape != self.shape:
            raise InputError(f"{path} is {image.shape[1]}x{image.shape[0]} but {self.paths[0]} "
                             f"is {self.shape[1]}x{self.shape[0]}: FID needs images of one size; "
                             f"resize or crop them")
        return image

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        paths = self.paths[index]
        if not paths:
            return np.zeros((0, *self.shape), np.uint8)
        return np.stack(list(self.pool.map(self._read_checked, paths)))  # (n, H, W, 3)


def load_images(source):
    """A folder of images or an .npz of uint8 images (`arr_0`, as DiT's sample_ddp.py writes) -> a
    sequence."""
    if os.path.isdir(source):
        return ImageFolder(source)
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source}: no such folder or file")
    if not source.endswith(".npz"):
        raise InputError(f"{source}: expected a folder of images or an .npz with the images in "
                         f"`arr_0`")
    images = read_npz(source, ["arr_0"]).get("arr_0")
    if images is None:
        raise InputError(f"{source} holds no images (`arr_0`, uint8 (N, H, W, 3)); give a folder "
                         f"of images or an .npz of them")
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise InputError(f"{source}: arr_0 is {images.dtype} {images.shape}, not uint8 RGB images "
                         f"(N, H, W, 3); convert floats in [0, 1] with "
                         f"(x * 255).round().clip(0, 255).astype(np.uint8)")
    return images


def image_statistics(images, inception, batch_size=128, progress=True, protocol=DEFAULT_PROTOCOL):
    """InceptionFeatures.result() of a sequence of uint8 images (an array or an ImageFolder).

    Under `jax.distributed` each process reads every process_count-th image, so together they cover
    it once.
    """
    rank, world = jax.process_index(), jax.process_count()
    mine = range(rank, len(images), world)
    features = InceptionFeatures(inception, batch_size, progress, protocol)
    chunk = 8 * batch_size * jax.local_device_count()  # images held in host memory at a time
    # the same for every process, as update needs
    calls = -(-len(range(0, len(images), world)) // chunk)
    with tqdm(total=len(mine), unit="img", desc="Inception", disable=not features.progress) as bar:
        for i in range(calls):
            indices = mine[i * chunk:(i + 1) * chunk]  # empty for a process whose share is shorter
            features.update(images[indices.start:indices.stop:world], bar)
    return features.result()


#################################################################################
#                        Evaluation entry point and CLI                         #
#################################################################################

IS_SPLIT_SIZE = 5000  # samples per part of the Inception Score in OpenAI's evaluator


def scores(out, ref=None):
    """The five numbers of InceptionFeatures.result() `out` against a reference (load_reference's
    dict, or None): {"protocol", "count", "fid", "sfid", "inception_score", "inception_score_std",
    "precision", "recall"}, None where the reference (or too few images) does not allow one."""
    protocol, count = out["protocol"], out["count"]
    if ref is not None and ref["protocol"] != protocol:
        raise InputError(f"the reference was made with the {ref['protocol']} protocol, the samples "
                         f"were fed to the Inception with the {protocol} protocol: their figures "
                         f"do not compare")
    result = {"protocol": protocol, "count": count, "fid": None, "sfid": None,
              "inception_score": None, "inception_score_std": None, "precision": None,
              "recall": None}
    if protocol == "adm":
        score = inception_score(out["score_logits"], split_size=IS_SPLIT_SIZE)
    else:  # 10 splits need at least 10 images; a tiny evaluation reports the others
        score = inception_score(out["score_logits"]) if count >= 10 else (None, None)
    result["inception_score"], result["inception_score_std"] = score
    if ref is None:
        return result
    result["fid"] = frechet_distance(out["mu"], out["sigma"], ref["mu"], ref["sigma"])
    if "mu_s" in ref:
        result["sfid"] = frechet_distance(out["mu_s"], out["sigma_s"], ref["mu_s"],
                                          ref["sigma_s"])
    if "pool" in ref and min(count, len(ref["pool"])) > PR_NEIGHBOURS:
        result["precision"], result["recall"] = precision_recall(ref["pool"], out["pool"])
    return result


def describe(result):
    """One line of the figures that `result` (scores()) has, each named with its sample count and
    protocol: "FID-10K (adm) 2.270, sFID-10K 4.60, IS-10K 278.2, Precision-10K 0.83, ..."."""
    n = f"{result['count'] / 1000:g}K"
    names = (("fid", "FID", ".3f"), ("sfid", "sFID", ".3f"), ("inception_score", "IS", ".2f"),
             ("precision", "Precision", ".4f"), ("recall", "Recall", ".4f"))
    figures = [f"{label}-{n} ({result['protocol']}) {result[key]:{spec}}"
               for key, label, spec in names if result[key] is not None]
    return ", ".join(figures) or f"no figures of {result['count']} images ({result['protocol']})"


def evaluate(images, ref=None, inception=None, batch_size=128, progress=True, protocol=None):
    """The five numbers (scores()) of uint8 images (N, H, W, 3) against a reference, with the
    statistics ("mu", "sigma", "mu_s", "sigma_s") and pool features ("pool") of the images.

    `ref` is the path of a statistics or reference .npz, or load_reference's dict; without it only
    the Inception Score is computed. The protocol is the reference's (an error if `protocol` names
    another), else `protocol`, else DEFAULT_PROTOCOL. The features that OpenAI's reference batches
    keep as images are computed once and kept in the dict. Under `jax.distributed` each process
    passes its own images and gets the figures over all of them.
    """
    # read first: a bad path fails before the long pass
    if isinstance(ref, (str, os.PathLike)):
        ref = load_reference(ref)
    if ref is not None and protocol not in (None, ref["protocol"]):
        raise InputError(f"the reference was made with the {ref['protocol']} protocol, not "
                         f"{protocol}; make one with `python fid.py ref IMAGES OUT.npz --protocol "
                         f"{protocol}`")
    protocol = ref["protocol"] if ref is not None else protocol or DEFAULT_PROTOCOL
    inception = inception or load_inception()
    if ref is not None and "images" in ref and "pool" not in ref:
        ref["pool"] = image_statistics(ref.pop("images"), inception, batch_size, progress,
                                       protocol)["pool"]
    features = InceptionFeatures(inception, batch_size, progress, protocol)
    with tqdm(total=len(images), unit="img", desc="Inception",
              disable=not features.progress) as bar:
        features.update(images, bar)
    out = features.result()
    return {**scores(out, ref),
            **{key: out[key] for key in ("mu", "sigma", "mu_s", "sigma_s", "pool")}}


def _is_statistics_file(source):
    return (source.endswith(".npz") and os.path.isfile(source)
            and len(read_npz(source, ["mu", "sigma"])) == 2)


def random_weights(build, seed=0):
    """The module that `build` makes, with random values drawn on the host rather than by its
    initialisers, for benchmarks, whose speed does not depend on the values: XLA took half a
    minute to compile the initialisers of the InceptionV3 or of the SD VAE on a 2-core CPU. Arrays
    of two or more dimensions (kernels) are normal with variance 1 / fan-in, the product of all but
    their last dimension; vectors (biases, norm scales, BatchNorm statistics) are ones."""
    graphdef, state = nnx.split(nnx.eval_shape(build))  # shapes only
    rng = np.random.default_rng(seed)

    def draw(leaf):  # jax.ShapeDtypeStruct -> array
        if len(leaf.shape) < 2:
            return jnp.asarray(np.ones(leaf.shape, leaf.dtype))
        kernel = rng.standard_normal(leaf.shape, np.float32) / math.sqrt(math.prod(leaf.shape[:-1]))
        return jnp.asarray(kernel, leaf.dtype)

    return nnx.merge(graphdef, jax.tree.map(draw, state))


def benchmark(batch_sizes, image_size=256, steps=5):
    """Print images/s of the jit-compiled, sharded feature extractor (random weights: speed does not
    depend on them). Each step is timed from host uint8 images to features on the device."""
    inception = random_weights(lambda: InceptionV3(rngs=nnx.Rngs(0)))
    devices = jax.device_count()
    print(f"InceptionV3 on {devices} x {jax.devices()[0].device_kind}, {image_size}x{image_size} "
          f"uint8 inputs resized to 299x299")
    for per_device in batch_sizes:
        features = InceptionFeatures(inception, per_device, progress=False)
        shape = (per_device * jax.local_device_count(), image_size, image_size, 3)  # (B, H, W, 3)
        images = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        def step():
            inputs = multihost_utils.host_local_array_to_global_array(images, features.mesh,
                                                                      P("batch"))
            return features.forward(features.state, inputs)

        jax.block_until_ready(step())  # compile
        start = time.perf_counter()
        for _ in range(steps):
            outputs = step()
        jax.block_until_ready(outputs)
        rate = steps * per_device * devices / (time.perf_counter() - start)
        print(f"batch {per_device:5d} per device: {rate:9.1f} images/s")


def _at_least(minimum):
    """The argparse type of sizes and counts: a whole number of at least `minimum`."""
    def whole_number(text):
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {minimum}, got "
                                             f"{text!r}")
        return value
    return whole_number


positive_int, non_negative_int = _at_least(1), _at_least(0)


def _positive_ints(text):
    return [positive_int(part) for part in text.split(",")]


def main(argv=None):
    parser = argparse.ArgumentParser(description="FID, sFID, Inception Score, Precision and Recall "
                                     "with pytorch-fid's InceptionV3, in JAX. A source is a folder "
                                     "of images, an .npz of uint8 images (arr_0) or, where "
                                     "statistics suffice, an .npz of statistics (mu, sigma) or a "
                                     "reference batch (`ref`, or OpenAI's).")
    commands = parser.add_subparsers(dest="command", required=True)
    stats = commands.add_parser("stats", help="save the FID statistics of a source to OUT.npz "
                                "(pytorch-fid's layout, mu and sigma)")
    stats.add_argument("source")
    stats.add_argument("out")
    reference = commands.add_parser("ref", help="save a reference batch of a source to OUT.npz "
                                    "(OpenAI's evaluator's layout: FID and sFID statistics, and "
                                    "the pool features that Precision and Recall use)")
    reference.add_argument("source")
    reference.add_argument("out")
    reference.add_argument("--pr-images", type=positive_int, default=REF_PR_IMAGES,
                           help="images whose features are kept for Precision and Recall")
    distance = commands.add_parser("fid", help="the five numbers of a source against a reference "
                                   "(e.g. samples.npz and ref.npz); FID alone between statistics")
    distance.add_argument("source1")
    distance.add_argument("source2")
    score = commands.add_parser("is", help="Inception Score of a source of images")
    score.add_argument("source")
    for command in (stats, reference, distance, score):
        command.add_argument("--weights", help=f"pytorch-fid's {FID_WEIGHTS_NAME} (default: cache, "
                             f"else download)")
        command.add_argument("--batch-size", type=positive_int, default=128,
                             help="images per device per step")
        command.add_argument("--protocol", choices=PROTOCOLS,
                             help=f"how images become features (default: a reference's own, "
                             f"else {DEFAULT_PROTOCOL}): adm is OpenAI's evaluator, which computed "
                             f"the DiT paper's figures; pytorch-fid is pytorch-fid's")
    bench = commands.add_parser("bench", help="images/s of the feature extractor")
    bench.add_argument("--batch-sizes", type=_positive_ints, default=None,
                       help="per-device batch sizes, comma-separated")
    bench.add_argument("--image-size", type=positive_int, default=256)
    args = parser.parse_args(argv)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)

    if args.command == "bench":
        default = [4, 8, 16] if jax.default_backend() == "cpu" else [32, 64, 128, 256, 512]
        benchmark(args.batch_sizes or default, args.image_size)
        return
    inception = None

    def features(source, protocol):
        nonlocal inception
        images = load_images(source)  # bad sources fail before the weights are fetched
        inception = inception or load_inception(args.weights)
        out = image_statistics(images, inception, args.batch_size, protocol=protocol)
        say(f"{source}: {out['count']} images ({protocol})")
        return out

    protocol = args.protocol or DEFAULT_PROTOCOL
    if args.command in ("stats", "ref"):
        if _is_statistics_file(args.source):
            raise InputError(f"{args.source} already holds statistics (mu, sigma); give images to "
                             f"compute them from")
        out = features(args.source, protocol)
        if jax.process_index() == 0:
            if args.command == "stats":
                save_statistics(args.out, out["mu"], out["sigma"], protocol)
            else:
                out["pool"] = out["pool"][evenly_spaced(out["count"], args.pr_images)]
                save_reference(args.out, out)
        say(f"saved the {protocol} {'statistics' if args.command == 'stats' else 'reference'} "
            f"of {out['count']} images to {args.out}")
    elif args.command == "fid":
        if _is_statistics_file(args.source2):
            ref = load_reference(args.source2)
            if args.protocol not in (None, ref["protocol"]):
                raise InputError(f"{args.source2} was made with the {ref['protocol']} protocol, "
                                 f"not {args.protocol}")
            protocol = ref["protocol"]
        else:
            out = features(args.source2, protocol)
            ref = {key: out[key] for key in ("protocol", "mu", "sigma", "mu_s", "sigma_s", "pool")}
        if _is_statistics_file(args.source1):  # statistics against statistics: FID (and sFID)
            other = load_reference(args.source1)
            result = {**dict.fromkeys(("fid", "sfid", "inception_score", "precision",
                                       "recall")),
                      "protocol": other["protocol"], "count": 0}
            if other["protocol"] != ref["protocol"]:
                raise InputError(f"{args.source1} was made with the {other['protocol']} protocol, "
                                 f"{args.source2} with {ref['protocol']}: they do not compare")
            result["fid"] = frechet_distance(other["mu"], other["sigma"], ref["mu"], ref["sigma"])
            if "mu_s" in other and "mu_s" in ref:
                result["sfid"] = frechet_distance(other["mu_s"], other["sigma_s"], ref["mu_s"],
                                                  ref["sigma_s"])
            say(", ".join(f"{name} ({result['protocol']}) {result[key]:.4f}"
                          for key, name in (("fid", "FID"), ("sfid", "sFID"))
                          if result[key] is not None))
            return
        say(describe(scores(features(args.source1, protocol), ref)))
    elif args.command == "is":
        out = features(args.source, protocol)
        result = scores(out)
        say(f"Inception Score-{out['count'] / 1000:g}K ({protocol}): "
            f"{result['inception_score']:.4f} +- {result['inception_score_std']:.4f}")


if __name__ == "__main__":
    run_cli(main)
