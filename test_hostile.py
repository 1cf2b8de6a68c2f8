"""Hostile and damaged files against the readers and command lines of fid.py and
prepare_imagenet100.py.

Every failure a user's file can cause must end a command in one line, `error: ...`, naming the
file, with a non-zero status and no traceback; no file may run code or make a reader allocate what
the file does not hold. The files are built here by hand (no torch needed): pickles that reach
os.system, builtins.eval or subprocess.call through several opcodes and protocols, size fields
that lie, truncated archives, object arrays and wrong shapes. Each payload would create a marker
file if it ran; the marker must never appear.

Each command-line case is its own run (a Python with jax starts in about 3 s), on a representative
set of files; the remaining files go through the reader functions in-process.
Run: python -m pytest -q test_hostile.py
"""
import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import threading
import zipfile
import zlib

import numpy as np
import pytest
from PIL import Image

import fid

HERE = os.path.dirname(os.path.abspath(__file__))
# A Python with jax imported holds about 250 MiB here. Every size claimed below is 8 GiB or more,
# so a reader that believed one and filled what it asked for would exceed this bound.
MEMORY_BOUND_KIB = 1 << 20


#################################################################################
#                        Pickles that try to run code                           #
#################################################################################

def _text(s):
    """BINUNICODE: a str, in any protocol from 1 on."""
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def payloads(marker):
    """{name: pickle bytes}, each of which creates `marker` when plain pickle loads it."""
    command = f"touch {marker}"
    return {
        # protocol 2: GLOBAL os.system, the command as a 1-tuple, REDUCE
        "global_reduce": b"\x80\x02cos\nsystem\n" + _text(command) + b"\x85R.",
        "eval": (b"\x80\x02cbuiltins\neval\n" + _text(f"__import__('os').system({command!r})")
                 + b"\x85R."),
        # protocol 4: STACK_GLOBAL takes module and name from the stack (MEMOIZE after each)
        "stack_global": (b"\x80\x04" + _text("subprocess") + b"\x94" + _text("call") + b"\x94\x93"
                         + b"](" + _text("touch") + _text(str(marker)) + b"e\x85R."),
        # protocol 0: INST names the callable inline and calls it on the arguments after MARK
        "inst": b"(S'" + command.encode() + b"'\nios\nsystem\n.",
        # protocol 1: OBJ calls the callable just above MARK on the arguments above it
        "obj": b"(cos\nsystem\nS'" + command.encode() + b"'\no.",
    }


class _RunsShellCommand:
    """numpy pickles this into an object array; unpickling it runs the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


#################################################################################
#                  torch.save files and .npz files, written by hand             #
#################################################################################

def _state_dict(tensors):
    """Protocol-2 pickle of {name: tensor}, each tensor given as (storage key, storage numel,
    size), contiguous float32, as torch.save writes it."""
    def ints(values):
        return b"(" + b"".join(b"\x8a\x08" + struct.pack("<q", v) for v in values) + b"t"

    out = b"\x80\x02}("
    for name, (key, numel, size) in tensors.items():
        strides = [int(np.prod(size[i + 1:])) for i in range(len(size))]
        storage = (b"(" + _text("storage") + b"ctorch\nFloatStorage\n" + _text(key) + _text("cpu")
                   + ints([numel])[1:-1] + b"tQ")
        out += (_text(name) + b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage + b"K\x00"
                + ints(size) + ints(strides) + b"\x89ccollections\nOrderedDict\n)RtR")
    return out + b"u."


def write_torch_zip(path, data_pkl, storages=(), compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data_pkl, compress_type=compress)
        z.writestr("archive/byteorder", "little")
        for key, raw in storages:
            z.writestr(f"archive/data/{key}", raw)


def write_torch_legacy(path, object_pkl, storages=()):
    """torch's legacy format; storages are (key, element count written before the bytes, bytes)."""
    with open(path, "wb") as f:
        f.write(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2))
        f.write(pickle.dumps(1001, protocol=2))
        f.write(pickle.dumps({"protocol_version": 1001, "little_endian": True}, protocol=2))
        f.write(object_pkl)
        f.write(pickle.dumps([key for key, _, _ in storages], protocol=2))
        for _, count, raw in storages:
            f.write(struct.pack("<q", count) + raw)


def npy_header(shape, dtype):
    """The header of an .npy file (format 1.0) that announces `shape` and `dtype`."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
            "shape": shape})
    return f.getvalue()


def write_zip_entries(path, entries):
    """A zip of the stored entries (name, data), whatever the data's own headers claim."""
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries:
            z.writestr(name, data)


def write_overlapping_zip(path, plain, overlapping, kernel):
    """A zip holding the `plain` entries (name, data), then the `overlapping` ones, stored so that
    each one's data runs on through the local headers of those after it to the end of `kernel`:
    the 'overlapping files' zip bomb, whose n entries hold about n times the file. The central
    directory lists the innermost entry (data = kernel) first."""
    def local_header(name, data):
        return struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, zlib.crc32(data),
                           len(data), len(data), len(name), 0) + name.encode()

    body, directory = b"", []
    for name, data in plain:
        directory.append((name, data, len(body)))
        body += local_header(name, data) + data
    tail, nested = kernel, []
    for name in reversed(overlapping):
        nested.insert(0, (name, tail))
        tail = local_header(name, tail) + tail
    offset = len(body)
    for name, data in nested:
        directory.append((name, data, offset))
        offset += len(local_header(name, data))
    directory = directory[:len(plain)] + directory[len(plain):][::-1]
    body += tail
    central = b"".join(
        struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, zlib.crc32(data),
                    len(data), len(data), len(name), 0, 0, 0, 0, 0, at) + name.encode()
        for name, data, at in directory)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(directory), len(directory),
                      len(central), len(body), 0)
    with open(path, "wb") as f:
        f.write(body + central + end)


#################################################################################
#                 The hostile files, and running a command on one               #
#################################################################################

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: path} of the hostile and damaged files, the good files the commands need beside
    them, and "marker", the file any payload would create."""
    d = tmp_path_factory.mktemp("hostile")
    marker = d / "MARKER"
    code = payloads(marker)
    paths = {"marker": str(marker), "dir": str(d)}

    def put(name, raw=None):
        paths[name] = str(d / name)
        if raw is not None:
            (d / name).write_bytes(raw)
        return paths[name]

    write_torch_legacy(put("legacy_reduce.pth"), code["global_reduce"])
    write_torch_zip(put("zip_eval.pt"), code["eval"])
    put("protocol4_call.pt", code["stack_global"])
    put("inst.pt", code["inst"])
    put("empty.pt", b"")
    put("bytes8_8GiB.pt", b"\x80\x04\x8e" + struct.pack("<Q", 1 << 33) + b"tiny.")
    write_torch_zip(put("zip_numel_2_40.pt"), _state_dict({"w": ("0", 1 << 40, (1 << 40,))}),
                    [("0", bytes(16))])
    write_torch_legacy(put("legacy_numel_2_60.pth"), _state_dict({"w": ("0", 1 << 60, (4,))}),
                       [("0", 1 << 60, bytes(16))])

    np.savez(put("object.npz"), arr_0=np.array([_RunsShellCommand(f"touch {marker}")], object))
    write_zip_entries(put("header_2_40.npz"), [("arr_0.npy", npy_header((1 << 40,), np.uint8)
                                                  + bytes(16))])
    np.savez(put("stats.npz"), mu=np.zeros(8), sigma=np.eye(8))
    put("truncated.npz", (d / "stats.npz").read_bytes()[:700])
    np.savez(put("float_images.npz"), arr_0=np.zeros((4, 8, 8, 3), np.float32))
    np.savez(put("images.npz"), arr_0=np.zeros((10, 8, 8, 3), np.uint8))
    put("missing.npz")
    put("out.npz")

    # Trees for prepare_imagenet100.py: one class of one image, then the same with a damaged
    # Labels.json, and an output folder whose manifest.json is damaged.
    for tree in ("src", "src_labels"):
        os.makedirs(d / tree / "n01440764")
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(d / tree / "n01440764" / "a.png")
        paths[tree] = str(d / tree)
    put("src_labels/Labels.json", b'{"n01440764": "tench, Tinca tin')
    os.makedirs(d / "out_manifest")
    put("out_manifest/manifest.json", b'{"settings": {"split": "train"}, "chunks_')
    for out in ("out_vae", "out_inception", "out_labels", "out_manifest"):
        paths[out] = str(d / out)
    return paths


def run_command(script, args, files):
    """(exit status, stderr, peak resident memory in KiB) of `python script *args`, the peak read
    from the child's own rusage (os.wait4), which counts it alone."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", DIT_CACHE=os.path.join(files["dir"], "cache"))
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, script), *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, cwd=files["dir"])
        timer = threading.Timer(300, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        err.seek(0)
        return proc.returncode, err.read().decode(errors="replace"), usage.ru_maxrss


# (command, arguments, the file the error must name, what the error must say). `says` tells the
# check that refused the file from an accident further on.
COMMAND_CASES = {
    "npz object array": ("fid.py", ["fid", "object.npz", "stats.npz"], "object.npz", "objects"),
    "npz header claims 2**40": ("fid.py", ["fid", "stats.npz", "header_2_40.npz"],
                                "header_2_40.npz", "claims shape"),
    "npz truncated": ("fid.py", ["stats", "truncated.npz", "out.npz"], "truncated.npz",
                      "not a readable .npz"),
    "npz wrong shape": ("fid.py", ["is", "float_images.npz"], "float_images.npz", "float32"),
    "missing file": ("fid.py", ["fid", "missing.npz", "stats.npz"], "missing.npz", "no such"),
    "legacy GLOBAL+REDUCE": ("fid.py", ["stats", "images.npz", "out.npz", "--weights",
                                        "legacy_reduce.pth"], "legacy_reduce.pth", "os.system"),
    "zip builtins.eval": ("fid.py", ["is", "images.npz", "--weights", "zip_eval.pt"],
                          "zip_eval.pt", "builtins.eval"),
    "protocol 4 STACK_GLOBAL": ("fid.py", ["fid", "images.npz", "stats.npz", "--weights",
                                           "protocol4_call.pt"], "protocol4_call.pt",
                                "subprocess.call"),
    "zip storage numel 2**40": ("fid.py", ["is", "images.npz", "--weights", "zip_numel_2_40.pt"],
                                "zip_numel_2_40.pt", f"claims {1 << 40} elements"),
    "legacy storage count 2**60": ("fid.py", ["is", "images.npz", "--weights",
                                              "legacy_numel_2_60.pth"], "legacy_numel_2_60.pth",
                                   f"claims {1 << 60} elements"),
    "empty torch file": ("fid.py", ["is", "images.npz", "--weights", "empty.pt"], "empty.pt",
                         "empty"),
    "BINBYTES8 claims 8 GiB": ("fid.py", ["is", "images.npz", "--weights", "bytes8_8GiB.pt"],
                               "bytes8_8GiB.pt", f"expected {1 << 33} bytes"),
    "prepare --vae builtins.eval": ("prepare_imagenet100.py", ["src", "out_vae", "--vae",
                                                               "zip_eval.pt", "--no-fid"],
                                    "zip_eval.pt", "builtins.eval"),
    "prepare --inception INST": ("prepare_imagenet100.py", ["src", "out_inception", "--pixels", "8",
                                                            "--inception", "inst.pt"],
                                 "inst.pt", "os.system"),
    "prepare Labels.json": ("prepare_imagenet100.py", ["src_labels", "out_labels", "--pixels", "8",
                                                       "--no-fid"], "src_labels/Labels.json",
                            "not valid JSON"),
    "prepare manifest.json": ("prepare_imagenet100.py", ["src", "out_manifest", "--pixels", "8",
                                                         "--no-fid"],
                              "out_manifest/manifest.json", "not valid JSON"),
}


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_command_refuses_in_one_line(files, case):
    script, args, named, says = COMMAND_CASES[case]
    # Paths as a user would type them: absolute, so that the message can be checked for them.
    args, named = [files.get(a, a) for a in args], files[named]
    status, stderr, peak_kib = run_command(script, args, files)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert status != 0 and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert named in lines[0] and says in lines[0], lines[0]
    assert not os.path.exists(files["marker"])
    assert peak_kib < MEMORY_BOUND_KIB, f"peak memory {peak_kib >> 10} MiB"


#################################################################################
#                    The same and more files, in-process                        #
#################################################################################

def test_payloads_are_armed(tmp_path):
    """Plain pickle runs every payload here (which is why no reader may use it on a user's file):
    the marker staying away in the other tests means the readers refused them."""
    marker = tmp_path / "MARKER"
    for name, raw in payloads(marker).items():
        pickle.loads(raw)
        assert marker.exists(), name
        marker.unlink()
    armed = np.array([_RunsShellCommand(f"touch {marker}")], object)
    np.savez(tmp_path / "object.npz", arr_0=armed)
    with np.load(tmp_path / "object.npz", allow_pickle=True) as f:
        f["arr_0"]
    assert marker.exists()


def test_hand_written_files_are_read_when_honest(tmp_path):
    """The writers above make files the readers accept, so a refusal below is of the lie alone."""
    values = np.arange(6, dtype=np.float32)
    pkl = _state_dict({"w": ("0", 6, (2, 3))})
    write_torch_zip(tmp_path / "good.pt", pkl, [("0", values.tobytes())])
    write_torch_legacy(tmp_path / "good.pth", pkl, [("0", 6, values.tobytes())])
    for name in ("good.pt", "good.pth"):
        got = fid.load_torch(str(tmp_path / name))["w"]
        np.testing.assert_array_equal(got, values.reshape(2, 3))
    write_zip_entries(tmp_path / "good.npz", [("a.npy", npy_header((2, 3), np.float32)
                                               + values.tobytes())])
    got = fid.read_npz(str(tmp_path / "good.npz"))["a"]
    np.testing.assert_array_equal(got, values.reshape(2, 3))
    # Every entry of the overlapping zip reads with plain zipfile, together several times the file.
    write_overlapping_zip(tmp_path / "overlap.zip", [], ["a", "b", "c"], bytes(10000))
    with zipfile.ZipFile(tmp_path / "overlap.zip") as z:
        total = sum(len(z.read(name)) for name in ("a", "b", "c"))
    assert total > 2.5 * os.path.getsize(tmp_path / "overlap.zip")


def _refused(path, says, error=fid.InputError):
    """Read `path` with its reader and require a refusal naming it and saying `says`, with at most
    16 MiB allocated on the way (tracemalloc counts what numpy and pickle ask for, even memory
    never touched)."""
    import tracemalloc
    reader = fid.read_npz if str(path).endswith(".npz") else fid.load_torch
    tracemalloc.start()
    try:
        with pytest.raises(error, match=re.escape(str(path)) + ".*" + says):
            reader(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{path}: {peak >> 20} MiB allocated"


def test_torch_reader_refuses_code_in_every_form(files, tmp_path):
    marker = tmp_path / "MARKER"
    names = {"global_reduce": "os.system", "eval": "builtins.eval",
             "stack_global": "subprocess.call", "inst": "os.system", "obj": "os.system"}
    for name, raw in payloads(marker).items():
        (tmp_path / f"{name}.pt").write_bytes(raw)  # where the legacy format's magic number goes
        write_torch_legacy(tmp_path / f"{name}_legacy.pth", raw)
        write_torch_zip(tmp_path / f"{name}_zip.pt", raw)
        for path in (f"{name}.pt", f"{name}_legacy.pth", f"{name}_zip.pt"):
            _refused(tmp_path / path, re.escape(names[name]), fid.UnsafePickleError)
    assert not marker.exists() and not os.path.exists(files["marker"])


def test_torch_reader_checks_every_claim_before_allocating(files, tmp_path):
    _refused(files["zip_numel_2_40.pt"], f"claims {1 << 40} elements")
    _refused(files["legacy_numel_2_60.pth"], f"claims {1 << 60} elements")
    _refused(files["bytes8_8GiB.pt"], f"expected {1 << 33} bytes")
    _refused(files["empty.pt"], "empty")
    # The count before a legacy storage's bytes disagrees with the pickle.
    write_torch_legacy(tmp_path / "count.pth", _state_dict({"w": ("0", 4, (4,))}),
                       [("0", 1 << 60, bytes(16))])
    _refused(tmp_path / "count.pth", f"holds {1 << 60} elements where 4")
    # One memo index makes the unpickler allocate and zero twice as many 8-byte slots: 256 MiB
    # here, enough to fail the bound without straining the machine should the check go (an index
    # of 2**30 takes 16 GiB).
    bomb = b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 24) + b"."
    (tmp_path / "memo.pt").write_bytes(bomb)
    write_torch_zip(tmp_path / "memo_zip.pt", bomb)
    _refused(tmp_path / "memo.pt", f"memo index {1 << 24}")
    _refused(tmp_path / "memo_zip.pt", f"memo index {1 << 24}")
    write_torch_zip(tmp_path / "bytes8_zip.pt",
                    b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"x.")
    _refused(tmp_path / "bytes8_zip.pt", f"expected {1 << 40} bytes")
    # torch never compresses: a deflated data.pkl could expand a thousandfold.
    write_torch_zip(tmp_path / "deflated.pt", _state_dict({}), compress=zipfile.ZIP_DEFLATED)
    _refused(tmp_path / "deflated.pt", "data.pkl is compressed")
    # A data.pkl whose directory entry claims more bytes than the file holds.
    with zipfile.ZipFile(tmp_path / "long_pkl.pt", "w") as z:
        z.writestr("archive/data.pkl", _state_dict({}))
        z.infolist()[0].file_size = 1 << 40
    _refused(tmp_path / "long_pkl.pt", f"claims {1 << 40} bytes")
    # Storages whose zip entries overlap: each holds the next, the file holds them once.
    kernel = np.ones(4000, np.float32).tobytes()
    header = 30 + len("archive/data/1")  # one local header, which storage 0 holds beside the kernel
    pkl = _state_dict({"a": ("0", (header + len(kernel)) // 4, ((header + len(kernel)) // 4,)),
                       "b": ("1", len(kernel) // 4, (len(kernel) // 4,))})
    write_overlapping_zip(tmp_path / "overlap.pt", [("archive/data.pkl", pkl)],
                          ["archive/data/0", "archive/data/1"], kernel)
    _refused(tmp_path / "overlap.pt", "more than the file holds")
    # Many tensors viewing one storage: each costs the pickle a few bytes, and memory its size.
    pkl = _state_dict({f"v{i}": ("0", 4000, (4000,)) for i in range(200)})
    write_torch_zip(tmp_path / "views.pt", pkl, [("0", kernel)])
    _refused(tmp_path / "views.pt", "8 times the file's size")


def test_npz_reader_checks_every_claim_before_allocating(files, tmp_path):
    _refused(files["object.npz"], "objects")
    _refused(files["header_2_40.npz"], r"claims shape \(1099511627776,\)")
    _refused(files["truncated.npz"], "not a readable .npz")
    write_zip_entries(tmp_path / "negative.npz", [("a.npy", npy_header((-2, -3), np.uint8)
                                                   + bytes(6))])
    _refused(tmp_path / "negative.npz", r"claims shape \(-2, -3\)")
    write_zip_entries(tmp_path / "v3.npz", [("a.npy", b"\x93NUMPY\x03\x00" + bytes(8))])
    _refused(tmp_path / "v3.npz", r"format \(3, 0\)")
    (tmp_path / "pickle.npz").write_bytes(payloads(tmp_path / "MARKER")["global_reduce"])
    _refused(tmp_path / "pickle.npz", "not a readable .npz")
    # A deflated entry cannot expand more than 1032-fold.
    with zipfile.ZipFile(tmp_path / "deflate.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.npy", npy_header((8,), np.uint8) + bytes(8))
        z.infolist()[0].file_size = 1 << 40
    _refused(tmp_path / "deflate.npz", f"claims {1 << 40} bytes")
    # Entries that overlap: the innermost is a good array, the next holds it once more.
    kernel = npy_header((4000,), np.float64) + bytes(32000)
    write_overlapping_zip(tmp_path / "overlap.npz", [], ["b.npy", "a.npy"], kernel)
    _refused(tmp_path / "overlap.npz", "more than the file holds")
    assert not (tmp_path / "MARKER").exists()


def test_npz_reader_reads_what_numpy_writes(tmp_path):
    arrays = {"f": np.arange(12.0).reshape(3, 4), "fortran": np.asfortranarray(np.ones((3, 2))),
              "big_endian": np.arange(5, dtype=">i4"), "empty": np.zeros((0, 7), np.uint8),
              "scalar": np.array("text"), "record": np.zeros(2, [("x", "<f4"), ("y", "u1")])}
    for save in (np.savez, np.savez_compressed):
        save(tmp_path / "a.npz", **arrays)
        got = fid.read_npz(str(tmp_path / "a.npz"))
        assert set(got) == set(arrays)
        for name, want in arrays.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            np.testing.assert_array_equal(got[name], want)
        assert set(fid.read_npz(str(tmp_path / "a.npz"), ["f", "absent"])) == {"f"}


def test_statistics_and_images_name_the_file(tmp_path):
    np.savez(tmp_path / "text.npz", mu=np.array(["a", "b"]), sigma=np.array([["a"] * 2] * 2))
    with pytest.raises(fid.InputError, match=re.escape(str(tmp_path / "text.npz")) + ".*not a "
                       "real"):
        fid.load_statistics(str(tmp_path / "text.npz"))
    np.savez(tmp_path / "gray.npz", arr_0=np.zeros((2, 8, 8), np.uint8))
    with pytest.raises(fid.InputError, match=re.escape(str(tmp_path / "gray.npz")) + ".*uint8 RGB"):
        fid.load_images(str(tmp_path / "gray.npz"))
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(20))
    with pytest.raises(fid.InputError, match=re.escape(str(folder / "broken.png"))):
        fid.load_images(str(folder))


def test_prepare_names_damaged_inputs_and_outputs(tmp_path, monkeypatch):
    import prepare_imagenet100
    src, out = tmp_path / "src", tmp_path / "out"
    for split in ("train.X1/n01440764", "val.X/n01440764"):
        os.makedirs(src / split)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(src / split / "a.png")
    args = [str(src), str(out), "--pixels", "8", "--no-fid"]

    def refused(path, says, extra=()):
        with pytest.raises(fid.InputError, match=re.escape(str(path)) + ".*" + says):
            prepare_imagenet100.main(args + list(extra))

    (src / "Labels.json").write_text('["tench"]')
    refused(src / "Labels.json", "not an object")
    (src / "Labels.json").unlink()
    damaged = {"settings": {}, "chunks_done": [], "seconds": 1}  # chunks_done is not an object
    (out / "manifest.json").write_text(json.dumps(damaged))
    refused(out / "manifest.json", "not the manifest")
    (out / "manifest.json").unlink()
    (out / "classes.json").write_text('[{"name": "tench"}]')
    refused(out / "classes.json", "not a list", ["--split", "val"])
    (out / "classes.json").unlink()

    # A run interrupted after its chunks were written, before the final files.
    def interrupt(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare_imagenet100, "write_outputs", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_imagenet100.main(args)
    monkeypatch.undo()
    partial = out / "images.partial.npy"
    np.save(partial, np.zeros((1, 4, 4, 3), np.uint8))
    refused(partial, r"holds uint8 \(1, 4, 4, 3\), not uint8 \(1, 8, 8, 3\)")
    partial.write_bytes(partial.read_bytes()[:60])
    refused(partial, "damaged")


def test_run_cli_prints_one_line_for_the_user_and_a_traceback_for_bugs():
    def fails(error):
        def main(argv):
            raise error
        return main

    with pytest.raises(SystemExit) as info:
        fid.run_cli(fails(fid.InputError("a.npz is bad:\nthe library said\nso")))
    assert info.value.code == "error: a.npz is bad: the library said so"
    with pytest.raises(SystemExit) as info:
        fid.run_cli(fails(FileNotFoundError(2, "No such file or directory", "b.npz")))
    assert info.value.code == "error: b.npz: No such file or directory"
    with pytest.raises(KeyError):  # a bug: not caught, so Python prints its traceback
        fid.run_cli(fails(KeyError("x")))
    assert fid.run_cli(lambda argv: ("ran", argv), ["--flag"]) == ("ran", ["--flag"])
