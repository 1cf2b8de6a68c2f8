"""Tests of the Data section: every dataset format, and the deterministic, resumable, per-process Loader."""
import gzip
import hashlib
import io
import json
import os
import pickle
import struct
import tarfile
import threading
import time
import types
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

import fid
from dit import Dataset, Loader, load_dataset, read_idx
from dit import center_crop_arr

HERE = os.path.dirname(os.path.abspath(__file__))


def fixture(name):
    """Path of a reference file: $DIT_FIXTURES first, then the project's fixtures/; skip if in neither."""
    for d in (os.environ.get("DIT_FIXTURES"), os.path.join(HERE, "fixtures")):
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    pytest.skip(f"reference file {name!r} is in neither $DIT_FIXTURES nor fixtures/")


def data(name):
    d = os.environ.get("DIT_DATA")
    if not d or not os.path.exists(os.path.join(d, name)):
        pytest.skip(f"{name!r} needs $DIT_DATA (the shared real-image folder)")
    return os.path.join(d, name)


#################################################################################
#                                     MNIST                                     #
#################################################################################

def write_idx(path, arr, gz=False):
    """An IDX file as the format's description defines it: 00 00, type code, ndim, big-endian dims, data."""
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C}
    raw = bytes([0, 0, codes[arr.dtype], arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    raw += arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(raw) if gz else raw)


def test_mnist_real_test_digits(capsys):
    ds = load_dataset("mnist", data("mnist"))
    assert "test set" in capsys.readouterr().out  # only t10k is there: the one-line note
    assert ds.x.shape == (10000, 28, 28, 1) and ds.x.dtype == np.uint8
    assert ds.input_shape == (28, 28, 1) and not ds.is_latent and not ds.flip
    assert ds.labels[0] == 7  # the first test digit is a 7
    # the published class counts of the MNIST test set
    assert np.bincount(ds.labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert ds.num_classes == 10 and ds.class_names == [str(d) for d in range(10)]
    assert ds.x.max() == 255 and ds.x.min() == 0


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_synthetic_idx(tmp_path, gz):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 5, 6), dtype=np.uint8)
    labels = rng.integers(0, 10, 7).astype(np.uint8)
    suffix = ".gz" if gz else ""
    write_idx(tmp_path / f"train-images-idx3-ubyte{suffix}", images, gz)
    write_idx(tmp_path / f"train-labels-idx1-ubyte{suffix}", labels, gz)
    ds = load_dataset("mnist", str(tmp_path))
    np.testing.assert_array_equal(ds.x, images[..., None])
    np.testing.assert_array_equal(ds.labels, labels)
    # other element types decode big-endian
    ints = np.array([[1, -2], [70000, 3]], np.int32)
    write_idx(tmp_path / "ints.idx", ints, gz)
    np.testing.assert_array_equal(read_idx(str(tmp_path / "ints.idx")), ints)


def test_idx_malformed(tmp_path):
    good = np.zeros((3, 4, 4), np.uint8)
    write_idx(tmp_path / "good", good)
    raw = (tmp_path / "good").read_bytes()
    cases = {
        "magic": b"\x01\x02" + raw[2:],
        "type": raw[:2] + b"\x07" + raw[3:],
        "truncated": raw[:-5],
        "header": raw[:9],
        "gzip": gzip.compress(raw)[:-12],
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=name):  # the message names the file
            read_idx(str(tmp_path / name))
    # a valid pair whose counts disagree
    write_idx(tmp_path / "train-images-idx3-ubyte", good)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="3 images but .* 4 labels"):
        load_dataset("mnist", str(tmp_path))
    with pytest.raises(ValueError, match="28x28"):
        load_dataset("mnist", str(tmp_path), resolution=32)


def test_mnist_offline_says_what_to_put_where(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.gz") as info:
        load_dataset("mnist", str(tmp_path / "mnist"))
    assert str(tmp_path / "mnist") in str(info.value)
    assert not any(p.name.endswith(".part") for p in (tmp_path / "mnist").iterdir())


class FakeResponse(io.BytesIO):
    headers = {}


def test_download_verifies_checksum(tmp_path, monkeypatch):
    payload = os.urandom(3000)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: FakeResponse(payload))
    path = tmp_path / "sub" / "file.bin"
    fid.download("https://example.invalid/file.bin", str(path), hashlib.md5(payload).hexdigest(), "md5")
    assert path.read_bytes() == payload
    bad = tmp_path / "bad.bin"
    with pytest.raises(ValueError, match="corrupted"):
        fid.download("https://example.invalid/file.bin", str(bad), "0" * 32, "md5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]  # neither the file nor a partial one is left


#################################################################################
#                                   CIFAR-10                                    #
#################################################################################

class Py2Pickler(pickle._Pickler):
    """Writes pickles as Python 2's cPickle wrote CIFAR-10's: every string is a byte string (BINSTRING) and arrays
    are rebuilt through numpy.core.multiarray._reconstruct, numpy 1's module name."""
    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_string(self, obj):
        raw = obj if isinstance(obj, bytes) else obj.encode("latin1")
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    def save_builtin(self, obj, name=None):
        if obj is np.empty(0).__reduce__()[0]:
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
        else:
            self.save_global(obj, name)

    dispatch[bytes] = save_py2_string
    dispatch[str] = save_py2_string
    dispatch[types.BuiltinFunctionType] = save_builtin


def py2_pickle(obj):
    f = io.BytesIO()
    Py2Pickler(f, protocol=2).dump(obj)
    return f.getvalue()


CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def cifar_files(n=3, seed=0):
    """Five tiny training batches and batches.meta in the official layout, and the NHWC images they encode."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (5 * n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 5 * n)
    files = {}
    for b in range(5):
        chunk = images[b * n:(b + 1) * n]
        # each row: the 1024 red values, then green, then blue, each in row-major order
        rows = np.stack([np.concatenate([img[:, :, c].reshape(-1) for c in range(3)]) for img in chunk])
        files[f"data_batch_{b + 1}"] = py2_pickle({"batch_label": f"training batch {b + 1} of 5", "data": rows,
                                                   "labels": [int(v) for v in labels[b * n:(b + 1) * n]],
                                                   "filenames": [f"img_{i}.png" for i in range(n)]})
    files["batches.meta"] = py2_pickle({"label_names": CLASSES, "num_cases_per_batch": n, "num_vis": 3072})
    files["test_batch"] = files["data_batch_1"]
    return files, images, labels


def write_cifar_archive(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))


def test_cifar_archive(tmp_path):
    files, images, labels = cifar_files()
    write_cifar_archive(tmp_path / "cifar-10-python.tar.gz", files)
    ds = load_dataset("cifar10", str(tmp_path))
    np.testing.assert_array_equal(ds.x, images)
    np.testing.assert_array_equal(ds.labels, labels)
    assert ds.class_names == CLASSES and ds.num_classes == 10 and ds.flip and ds.input_shape == (32, 32, 3)


def test_cifar_extracted_folder(tmp_path):
    files, images, labels = cifar_files(n=2, seed=1)
    (tmp_path / "cifar-10-batches-py").mkdir()
    for name, content in files.items():
        (tmp_path / "cifar-10-batches-py" / name).write_bytes(content)
    ds = load_dataset("cifar10", str(tmp_path))
    np.testing.assert_array_equal(ds.x, images)
    np.testing.assert_array_equal(ds.labels, labels)
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4"):
        load_dataset("cifar10", str(tmp_path))


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_cifar_refuses_code_in_pickle(tmp_path):
    files, _, _ = cifar_files()
    marker = tmp_path / "it_ran"
    files["data_batch_3"] = py2_pickle({"data": RunsACommand(marker)})
    write_cifar_archive(tmp_path / "cifar-10-python.tar.gz", files)
    with pytest.raises(pickle.UnpicklingError, match="system") as info:
        load_dataset("cifar10", str(tmp_path))
    assert any("data_batch_3" in note for note in getattr(info.value, "__notes__", []))
    assert not marker.exists()


def test_cifar_damaged_archive(tmp_path):
    files, _, _ = cifar_files()
    del files["data_batch_5"]
    write_cifar_archive(tmp_path / "cifar-10-python.tar.gz", files)
    with pytest.raises(ValueError, match="data_batch_5"):
        load_dataset("cifar10", str(tmp_path))
    raw = (tmp_path / "cifar-10-python.tar.gz").read_bytes()
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ValueError, match="damaged|lacks"):
        load_dataset("cifar10", str(tmp_path))


#################################################################################
#                                 Image folder                                  #
#################################################################################

def real_jpegs(out, per_class=3, classes=2):
    """Extract the first few CIFAR-10 JPEGs of the first classes met in the shared archive (in archive order, so
    only its beginning is decompressed). Returns {class: [paths]}."""
    found = {}
    with tarfile.open(data("cifar10-jpeg.tar.gz"), "r:gz") as tar:
        for member in tar:
            parts = member.name.split("/")
            if not member.isfile() or len(parts) != 4 or parts[1] != "train":
                continue
            if parts[2] not in found and len(found) == classes:
                break
            paths = found.setdefault(parts[2], [])
            if len(paths) < per_class:
                path = os.path.join(out, parts[2], parts[3])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(tar.extractfile(member).read())
                paths.append(path)
    return found


def test_folder_with_classes(tmp_path):
    found = real_jpegs(tmp_path)
    names = sorted(found)
    files = [p for name in names for p in sorted(found[name])]
    ds = load_dataset("folder", str(tmp_path))
    assert ds.class_names == names and ds.num_classes == 2 and ds.flip
    np.testing.assert_array_equal(ds.labels, [names.index(os.path.basename(os.path.dirname(p))) for p in files])
    np.testing.assert_array_equal(ds.x, np.stack([np.asarray(Image.open(p).convert("RGB")) for p in files]))
    small = load_dataset("folder", str(tmp_path), resolution=16)
    expected = np.stack([center_crop_arr(Image.open(p).convert("RGB"), 16) for p in files])
    assert small.x.shape == (len(files), 16, 16, 3)
    np.testing.assert_array_equal(small.x, expected)


def test_folder_unconditional_broken_and_mixed(tmp_path):
    found = real_jpegs(tmp_path / "src", per_class=4, classes=1)
    flat = tmp_path / "flat"
    flat.mkdir()
    files = sorted(found[next(iter(found))])
    for p in files:
        os.replace(p, flat / os.path.basename(p))
    (flat / "zz_broken.jpg").write_bytes(b"not an image at all")
    (flat / "notes.txt").write_text("ignored: not an image")
    with pytest.warns(UserWarning, match="zz_broken.jpg"):
        ds = load_dataset("folder", str(flat))
    assert ds.labels is None and ds.num_classes == 0 and ds.class_names == []
    expected = np.stack([np.asarray(Image.open(flat / os.path.basename(p)).convert("RGB")) for p in files])
    np.testing.assert_array_equal(ds.x, expected)
    # a grayscale image of another size: needs a resolution, and becomes RGB
    Image.fromarray(np.full((40, 50), 200, np.uint8)).save(flat / "gray.png")
    with pytest.raises(ValueError, match="resolution"):
        load_dataset("folder", str(flat))
    with pytest.warns(UserWarning, match="zz_broken.jpg"):
        ds = load_dataset("folder", str(flat), resolution=24)
    assert ds.x.shape == (len(files) + 1, 24, 24, 3)


def test_folder_empty(tmp_path):
    with pytest.raises(ValueError, match="no images"):
        load_dataset("folder", str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_dataset("folder", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="data_dir"):
        load_dataset("folder")


#################################################################################
#                                 ImageNet-100                                  #
#################################################################################

def write_prepared(out, n=12, h=2, w=3, c=4, pixels=None, seed=0):
    """A prepare_imagenet100.py output folder written by hand. Latents: mean and std of the image and of its
    flip are kept apart (flip means are negative, image means positive) so a test can tell which was used."""
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)
    labels = rng.integers(0, 3, n).astype(np.int64)
    np.save(os.path.join(out, "labels.npy"), labels)
    with open(os.path.join(out, "classes.json"), "w") as f:
        json.dump([{"wnid": f"n0{i}", "name": f"class {i}"} for i in range(3)], f)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"resolution": 8 * h, "scaling_factor": 0.18215}, f)
    if pixels:
        images = rng.integers(0, 256, (n, pixels, pixels, 3), dtype=np.uint8)
        np.save(os.path.join(out, "images.npy"), images)
        return images, labels
    mean = rng.uniform(0.5, 2.0, (n, 2, h, w, c)) * np.array([1, -1]).reshape(1, 2, 1, 1, 1)
    std = rng.uniform(0.1, 0.5, (n, 2, h, w, c))
    latents = np.lib.format.open_memmap(os.path.join(out, "latents.npy"), "w+", np.float16, (n, 2, h, w, 2 * c))
    latents[:] = np.concatenate([mean, std], axis=-1)
    latents.flush()
    return np.array(latents), labels


def test_imagenet100_latents(tmp_path):
    latents, labels = write_prepared(str(tmp_path))
    ds = load_dataset("imagenet100", str(tmp_path))
    assert isinstance(ds.x, np.memmap) and ds.is_latent and ds.latent_scale == pytest.approx(0.18215)
    assert ds.input_shape == (2, 3, 4) and ds.class_names == ["class 0", "class 1", "class 2"]
    n, c, G, seed = len(latents), 4, 6, 11
    loader = Loader(ds, G, seed)
    chose = set()
    for step in range(4):
        # the recipe: epoch permutation from (seed, epoch); [image, flip] choice and eps from (seed, step, 1)
        epoch, pos = divmod(step, n // G)
        idx = np.random.default_rng((seed, epoch)).permutation(n)[pos * G:(pos + 1) * G]
        rng = np.random.default_rng((seed, step, 1))
        which = rng.integers(0, 2, G)
        eps = rng.standard_normal((G, 2, 3, c), dtype=np.float32)
        stats = latents[idx, which].astype(np.float32)
        expected = (stats[..., :c] + stats[..., c:] * eps) * np.float32(0.18215)
        x, y = loader.batch(step)
        assert x.dtype == np.float32 and y.dtype == np.int32
        np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(y, labels[idx])
        # image means are positive and flip means negative (std at most a quarter of |mean|): the sign of each
        # sample's average tells which one was taken
        np.testing.assert_array_equal(x.mean(axis=(1, 2, 3)) < 0, which == 1)
        chose |= set(which.tolist())
        # two processes draw the same global noise and flips and take their halves of it
        halves = [Loader(ds, G, seed, process_index=i, process_count=2).batch(step)[0] for i in range(2)]
        np.testing.assert_array_equal(np.concatenate(halves), x)
    assert chose == {0, 1}


def test_imagenet100_latent_noise_statistics(tmp_path):
    """Independently of the draw order: (z / scale - mean) / std must be standard normal."""
    n = 64
    latents, _ = write_prepared(str(tmp_path), n=n, h=4, w=4, c=4)
    ds = load_dataset("imagenet100", str(tmp_path))
    ds.flip = False  # always the image itself, so mean and std are known per index
    loader = Loader(ds, n, seed=3)
    x, _ = loader.batch(0)
    idx = np.random.default_rng((3, 0)).permutation(n)
    stats = latents[idx, 0].astype(np.float32)
    eps = (x / np.float32(0.18215) - stats[..., :4]) / stats[..., 4:]
    assert abs(eps.mean()) < 0.05 and abs(eps.std() - 1) < 0.05  # 4096 draws: 3 sigma is about 0.05
    assert not np.array_equal(loader.batch(1)[0], loader.batch(0)[0])


def test_imagenet100_pixels_and_errors(tmp_path):
    images, labels = write_prepared(str(tmp_path / "pix"), pixels=8)
    ds = load_dataset("imagenet100", str(tmp_path / "pix"))
    assert not ds.is_latent and ds.input_shape == (8, 8, 3) and ds.flip
    np.testing.assert_array_equal(ds.x, images)
    with pytest.raises(ValueError, match="resolution 8"):
        load_dataset("imagenet100", str(tmp_path / "pix"), resolution=16)
    with pytest.raises(FileNotFoundError, match="prepare_imagenet100.py"):
        load_dataset("imagenet100", str(tmp_path / "nothing"))
    manifest = json.loads((tmp_path / "pix" / "manifest.json").read_text())
    (tmp_path / "pix" / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(ValueError, match="did not finish"):
        load_dataset("imagenet100", str(tmp_path / "pix"))
    os.remove(tmp_path / "pix" / "labels.npy")
    with pytest.raises(FileNotFoundError, match="labels.npy.*prepare_imagenet100.py"):
        load_dataset("imagenet100", str(tmp_path / "pix"))
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet", str(tmp_path))


#################################################################################
#                                    Loader                                     #
#################################################################################

def numbered(n, flip=False, classes=5):
    """Pixel dataset whose image i holds 4*i + column, so a batch tells which samples it holds (and flips show)."""
    assert n <= 64
    x = (4 * np.arange(n)[:, None, None, None] + np.arange(4)[None, None, :, None]).astype(np.uint8)
    x = np.broadcast_to(x, (n, 4, 4, 1)).copy()  # (N, H, W, 1)
    return Dataset("numbered", x, np.arange(n) % classes, classes, [str(i) for i in range(classes)], flip=flip)


def sample_ids(x):
    return np.rint((x + 1) * 127.5).astype(int).min(axis=(1, 2, 3)) // 4


def test_loader_epochs_cover_dataset_without_repeats():
    n, G = 26, 8  # 3 steps per epoch; 2 samples dropped each epoch
    loader = Loader(numbered(n), G, seed=0)
    epochs = []
    for e in range(2):
        ids = np.concatenate([sample_ids(loader.batch(e * 3 + s)[0]) for s in range(3)])
        assert len(set(ids.tolist())) == 24 and set(ids.tolist()) <= set(range(n))
        epochs.append(ids)
    assert not np.array_equal(epochs[0], epochs[1])  # each epoch is shuffled afresh
    x, y = loader.batch(0)
    np.testing.assert_array_equal(y, sample_ids(x) % 5)


def test_loader_is_deterministic_resumable_and_process_independent():
    ds = numbered(40, flip=True)
    with Loader(ds, 8, seed=5) as a, Loader(ds, 8, seed=5) as b:
        first = [batch for _, batch in zip(range(7), a)]
        second = [batch for _, batch in zip(range(7), b)]
    for (xa, ya), (xb, yb) in zip(first, second):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    with Loader(ds, 8, seed=5, start_step=4) as resumed:
        for (x, y), (xr, yr) in zip(first[4:], resumed):
            np.testing.assert_array_equal(x, xr)
            np.testing.assert_array_equal(y, yr)
    with Loader(ds, 8, seed=6) as other:
        assert not np.array_equal(next(iter(other))[0], first[0][0])
    halves = [Loader(ds, 8, seed=5, process_index=i, process_count=2) for i in range(2)]
    for step in range(7):
        parts = [h.batch(step) for h in halves]
        assert parts[0][0].shape == (4, 4, 4, 1)
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), first[step][0])
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), first[step][1])


def test_loader_pixels_and_flips():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (64, 5, 6, 3), dtype=np.uint8)
    ds = Dataset("random", x, None, 0, [])
    loader = Loader(ds, 64, seed=1)
    out, y = loader.batch(0)
    assert out.shape == (64, 5, 6, 3) and out.dtype == np.float32 and (y == 0).all()
    idx = np.random.default_rng((1, 0)).permutation(64)
    plain, mirrored = x[idx] / 127.5 - 1, x[idx][:, :, ::-1] / 127.5 - 1
    is_plain = np.isclose(out, plain, atol=1e-6).all(axis=(1, 2, 3))
    is_mirrored = np.isclose(out, mirrored, atol=1e-6).all(axis=(1, 2, 3))
    assert (is_plain | is_mirrored).all() and is_plain.any() and is_mirrored.any()
    assert out.min() >= -1 and out.max() <= 1
    ds.flip = False
    np.testing.assert_allclose(Loader(ds, 64, seed=1).batch(0)[0], plain, atol=1e-6)


def test_loader_threads_stop_errors_propagate_and_prefetch_is_bounded():
    before = set(threading.enumerate())
    loader = Loader(numbered(16), 4, seed=0, prefetch=2)
    made = []
    compute = loader.batch
    loader.batch = lambda step: made.append(step) or compute(step)
    it = iter(loader)
    x, _ = next(it)
    np.testing.assert_array_equal(x, compute(0)[0])
    time.sleep(0.3)
    assert len(made) <= 1 + 2  # the one consumed and `prefetch` ahead, no more
    loader.close()
    assert set(threading.enumerate()) == before
    with pytest.raises(RuntimeError, match="closed"):
        next(it)

    class Unreadable(np.ndarray):
        def __getitem__(self, index):
            raise OSError("the disk went away")

    broken = Dataset("broken", np.zeros((8, 2, 2, 1), np.uint8).view(Unreadable), None, 0, [])
    with Loader(broken, 4, seed=0) as loader:
        with pytest.raises(OSError, match="disk went away"):
            next(iter(loader))
    assert set(threading.enumerate()) == before


def test_loader_rejects_bad_arguments():
    ds = numbered(10)
    with pytest.raises(ValueError, match="dataset size"):
        Loader(ds, 11, seed=0)
    with pytest.raises(ValueError, match="multiple of 3"):
        Loader(ds, 8, seed=0, process_count=3)
    with pytest.raises(ValueError, match="does not exist"):
        Loader(ds, 8, seed=0, process_index=2, process_count=2)
