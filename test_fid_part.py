"""Tests of fid.py: the restricted torch reader, the FID InceptionV3 against pytorch-fid, FID and IS."""

import io
import json
import pickle
import struct
import subprocess
import sys
import zipfile

import numpy as np
from flax import nnx
from PIL import Image

import fid

import os, pytest
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
#                    Hand-built torch.save files (no torch needed)              #
#################################################################################

class _Global:
    """A global `module.name` in a hand-written pickle."""
    def __init__(self, module, name):
        self.module, self.name = module, name


class _Call:
    """`func(*args)` in a hand-written pickle (REDUCE)."""
    def __init__(self, func, *args):
        self.func, self.args = func, args


class _PersistentId:
    def __init__(self, value):
        self.value = value


class _NewObj:
    """`cls.__new__(cls)` then `__dict__.update(state)` (NEWOBJ + BUILD), as protocol 2 pickles plain objects."""
    def __init__(self, cls, state):
        self.cls, self.state = cls, state


def _emit(x):
    """Pickle opcodes for x, written out by hand so that any global can be named without importing it."""
    if isinstance(x, _Global):
        return b"c" + f"{x.module}\n{x.name}\n".encode()
    if isinstance(x, _Call):
        return _emit(x.func) + _emit(tuple(x.args)) + b"R"
    if isinstance(x, _PersistentId):
        return _emit(x.value) + b"Q"
    if isinstance(x, _NewObj):
        return _emit(x.cls) + b")" + b"\x81" + _emit(x.state) + b"b"
    if isinstance(x, tuple):
        return b"(" + b"".join(_emit(v) for v in x) + b"t"
    if isinstance(x, list):
        return b"](" + b"".join(_emit(v) for v in x) + b"e"
    if isinstance(x, dict):
        return b"}(" + b"".join(_emit(k) + _emit(v) for k, v in x.items()) + b"u"
    return pickle.dumps(x, protocol=2)[2:-1]  # a scalar or string: pickle's own opcodes minus PROTO/STOP


def _pickle(obj):
    return b"\x80\x02" + _emit(obj) + b"."


def _tensor(storage_name, key, numel, offset, size, stride):
    """What torch writes for one tensor: _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())."""
    storage = _PersistentId(("storage", _Global("torch", storage_name), key, "cpu", numel))
    hooks = _Call(_Global("collections", "OrderedDict"))
    rebuild = _Global("torch._utils", "_rebuild_tensor_v2")
    return _Call(rebuild, storage, offset, tuple(size), tuple(stride), False, hooks)


def _write_zip(path, obj, storages):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("ckpt/data.pkl", _pickle(obj))
        z.writestr("ckpt/byteorder", "little")
        for key, raw in storages.items():
            z.writestr(f"ckpt/data/{key}", raw)


def _write_legacy(path, obj, storages, itemsizes):
    with open(path, "wb") as f:
        f.write(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2))
        f.write(pickle.dumps(1001, protocol=2))
        f.write(pickle.dumps({"protocol_version": 1001, "little_endian": True,
                              "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2))
        f.write(_pickle(obj))
        f.write(pickle.dumps(list(storages), protocol=2))
        for key, raw in storages.items():
            f.write(struct.pack("<q", len(raw) // itemsizes[key]) + raw)


def _handbuilt_checkpoint():
    """A DiT-style training checkpoint exercising offsets, strides, shared storages, bf16, int64, bool, Namespace."""
    bf16_values = np.array([1.0, -2.5, 0.15625, 2.0 ** 100], np.float32)  # all exactly representable in bfloat16
    storages = {
        "0": np.arange(24, dtype=np.float32).tobytes(),
        "1": (bf16_values.view(np.uint32) >> 16).astype("<u2").tobytes(),
        "2": np.array([7], "<i8").tobytes(),
        "3": np.array([True, False, True], np.bool_).tobytes(),
    }
    itemsizes = {"0": 4, "1": 2, "2": 8, "3": 1}
    weight = _Call(_Global("torch._utils", "_rebuild_parameter"), _tensor("FloatStorage", "0", 24, 2, (3, 4), (1, 3)),
                   True, _Call(_Global("collections", "OrderedDict")))
    obj = {
        "model": _Call(_Global("collections", "OrderedDict"), [
            ("w", weight),                                                  # transposed view at offset 2
            ("row", _tensor("FloatStorage", "0", 24, 20, (4,), (1,))),    # shares storage "0"
            ("bf16", _tensor("BFloat16Storage", "1", 4, 0, (2, 2), (2, 1))),
            ("mask", _tensor("BoolStorage", "3", 3, 0, (3,), (1,))),
        ]),
        "opt": {"state": {0: {"step": _tensor("LongStorage", "2", 1, 0, (), ())}},
                "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": [0]}]},
        "args": _NewObj(_Global("argparse", "Namespace"), {"model": "DiT-XL/2", "image_size": 256}),
    }
    expected = {  # name -> (values, dtype)
        "w": (2 + np.arange(3)[:, None] + 3 * np.arange(4)[None, :], np.float32),  # offset + i*stride0 + j*stride1
        "row": (np.arange(20, 24), np.float32),
        "bf16": (bf16_values.reshape(2, 2), np.float32),  # bfloat16 comes back widened to float32
        "mask": (np.array([True, False, True]), np.bool_),
    }
    return obj, storages, itemsizes, expected


#################################################################################
#                          Tests: restricted torch reader                       #
#################################################################################

@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_torch_handbuilt_checkpoint(tmp_path, fmt):
    obj, storages, itemsizes, expected = _handbuilt_checkpoint()
    path = str(tmp_path / "ckpt.pt")
    _write_zip(path, obj, storages) if fmt == "zip" else _write_legacy(path, obj, storages, itemsizes)
    ckpt = fid.load_torch(path)
    for name, (want, dtype) in expected.items():
        got = ckpt["model"][name]
        assert got.shape == want.shape and got.dtype == dtype, name
        np.testing.assert_array_equal(got, want)
    step = ckpt["opt"]["state"][0]["step"]
    assert step.shape == () and step.dtype == np.int64 and step == 7
    assert ckpt["opt"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert ckpt["args"].model == "DiT-XL/2" and ckpt["args"].image_size == 256


def test_torch_zip_dit_reference():
    sd = fid.load_torch(fixture("dit_reference.pt"))
    config = json.loads(str(np.load(fixture("dit_reference.npz"))["config"]))
    hidden, p, c = config["hidden_size"], config["patch_size"], config["in_channels"]
    assert sd["x_embedder.proj.weight"].shape == (hidden, c, p, p)
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in sd.values())
    # pos_embed is the fixed 2-D sin-cos table of the DiT paper (MAE's get_2d_sincos_pos_embed): first half of the
    # channels encodes the column (w) index, second half the row (h) index, each as [sin(pos*omega), cos(pos*omega)].
    grid = config["input_size"] // p
    omega = 1.0 / 10000 ** (np.arange(hidden // 4) / (hidden / 4))
    h, w = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    def enc(pos):
        out = pos.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    want = np.concatenate([enc(w), enc(h)], axis=1)[None]
    np.testing.assert_allclose(sd["pos_embed"], want, atol=1e-6)
    # Every other weight was drawn from N(0, 0.05^2): a wrong dtype, offset or byte order would not look like that.
    others = np.concatenate([v.ravel() for k, v in sd.items() if k != "pos_embed"])
    assert others.size > 10000 and abs(others.std() - 0.05) < 0.002 and abs(others.mean()) < 0.002


def test_torch_legacy_inception_keys():
    sd = fid.load_torch(fixture("inception_fid_random.pth"))
    keys = json.load(open(fixture("pt_inception_keys.json")))
    assert set(sd) == set(keys) and len(keys) == 566
    dtypes = {"FloatStorage": np.float32, "LongStorage": np.int64}
    for name, info in keys.items():
        assert list(sd[name].shape) == info["shape"], name
        assert sd[name].dtype == dtypes[info["dtype"]], name
    running_vars = [v for k, v in sd.items() if k.endswith("running_var")]
    assert all(np.isfinite(v).all() and (v > 0).all() for v in running_vars)


class _RunsShellCommand:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_torch_refuses_malicious_pickle(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_RunsShellCommand(f"touch {marker}"), protocol=2)
    with pytest.raises(fid.UnsafePickleError, match="system"):
        fid.safe_unpickle(io.BytesIO(payload), {})
    # The same call hidden in a state dict, in both torch file formats.
    evil = {"weight": _Call(_Global("os", "system"), f"touch {marker}")}
    _write_zip(str(tmp_path / "evil.pt"), evil, {})
    _write_legacy(str(tmp_path / "evil.pth"), evil, {}, {})
    for name in ("evil.pt", "evil.pth"):
        with pytest.raises(fid.UnsafePickleError, match="os.system.*malicious"):
            fid.load_torch(str(tmp_path / name))
    # Allowing a harmless global does not open the door to others.
    allowed = {("collections", "OrderedDict"): dict}
    assert fid.safe_unpickle(io.BytesIO(_pickle(_Call(_Global("collections", "OrderedDict")))), allowed) == {}
    with pytest.raises(fid.UnsafePickleError):
        fid.safe_unpickle(io.BytesIO(_pickle(_Call(_Global("builtins", "eval"), "1"))), allowed)
    assert not marker.exists()


def test_torch_damaged_files_give_clear_errors(tmp_path):
    obj, storages, itemsizes, _ = _handbuilt_checkpoint()
    _write_zip(str(tmp_path / "good.pt"), obj, storages)
    _write_legacy(str(tmp_path / "good.pth"), obj, storages, itemsizes)
    cases = {"empty.pt": (b"", "empty"), "text.pt": (b"hello, not a checkpoint\n" * 10, "not a PyTorch file"),
             "garbage.pt": (np.random.default_rng(0).bytes(1000), None)}
    for name in ("good.pt", "good.pth"):
        raw = (tmp_path / name).read_bytes()
        cases["half_" + name] = (raw[: len(raw) // 2], None)
        cases["short_" + name] = (raw[:-5], None)
    # An archive that is not a torch file (e.g. an .npz) and one whose tensor data is shorter than declared.
    np.savez(tmp_path / "arrays.npz", a=np.zeros(3))
    cases["arrays.npz"] = ((tmp_path / "arrays.npz").read_bytes(), "data.pkl")
    short = dict(storages, **{"0": storages["0"][:40]})
    _write_zip(str(tmp_path / "short_storage.pt"), obj, short)
    cases["short_storage.pt"] = ((tmp_path / "short_storage.pt").read_bytes(), "truncated")
    for name, (raw, message) in cases.items():
        path = tmp_path / ("case_" + name)
        path.write_bytes(raw)
        with pytest.raises(ValueError, match=message) as info:
            fid.load_torch(str(path))
        assert str(path) in str(info.value), name


def test_torch_tensor_outside_its_storage_is_refused(tmp_path):
    obj = {"w": _tensor("FloatStorage", "0", 4, 2, (3,), (1,))}  # elements 2, 3, 4 of a 4-element storage
    _write_zip(str(tmp_path / "oob.pt"), obj, {"0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(ValueError, match="reaches element 4"):
        fid.load_torch(str(tmp_path / "oob.pt"))


#################################################################################
#                  Tests: InceptionV3, statistics, FID, IS, CLI                 #
#################################################################################

def _rel(ours, ref):
    ref = np.asarray(ref, np.float64)
    return np.linalg.norm(np.asarray(ours, np.float64) - ref) / np.linalg.norm(ref)


@pytest.fixture(scope="module")
def inception(tmp_path_factory):
    """The FID InceptionV3 with the random-weight fixture (the real weights are not needed for parity)."""
    weights = fixture("inception_fid_random.pth")
    with pytest.warns(UserWarning, match="not pytorch-fid's official"):
        return fid.load_inception(weights, cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_fid_resize_matches_torch_formula():
    # Hand-computed from torch's rule src = (i + 0.5) * in / out - 0.5, clamped at 0, linear between neighbours.
    # Upsampling 3 -> 5: src = 0 (clamped from -0.2), 0.4, 1.0, 1.6, 2.2 (the last pixel repeats past the edge).
    up = [[1, 0, 0], [0.6, 0.4, 0], [0, 1, 0], [0, 0.4, 0.6], [0, 0, 1]]
    np.testing.assert_allclose(fid.resize_matrix(3, 5), up, atol=1e-6)
    # Downsampling 5 -> 2: src = 0.75 and 3.25; no antialiasing, so pixel 2 does not contribute at all.
    down = [[0.25, 0.75, 0, 0, 0], [0, 0, 0, 0.75, 0.25]]
    np.testing.assert_allclose(fid.resize_matrix(5, 2), down, atol=1e-6)
    np.testing.assert_array_equal(fid.resize_matrix(299, 299), np.eye(299))
    # The 2-D resize applies the rule along each axis: out[i, j] = sum_hw R_rows[i, h] R_cols[j, w] x[h, w].
    x = np.random.default_rng(0).random((2, 3, 5, 4)).astype(np.float32)  # (B, H, W, C)
    out = np.asarray(fid.resize_bilinear(x, 5, 2))
    np.testing.assert_allclose(out, np.einsum("ih,jw,bhwc->bijc", np.array(up), np.array(down), x), atol=1e-6)


def test_fid_features_match_pytorch_fid_set32(inception):
    ref = np.load(fixture("inception_reference.npz"))
    n = 7  # a subset keeps the test short on a CPU
    images, pool, logits = ref["set32"][:n], ref["set32_pool3"][:n], ref["set32_logits"][:n]
    features = fid.InceptionFeatures(inception, batch_size=3, progress=False)  # 3 steps, the last one padded
    features.update(images)
    with pytest.warns(UserWarning, match="singular"):
        out = features.result()
    assert out["count"] == n and out["logits"].shape == logits.shape
    assert _rel(out["logits"], logits) < 1e-4
    assert _rel(out["mu"], pool.astype(np.float64).mean(axis=0)) < 1e-4
    assert _rel(out["sigma"], np.cov(pool.astype(np.float64), rowvar=False)) < 1e-4


def test_fid_evaluate_matches_pytorch_fid_features(inception):
    ref = np.load(fixture("inception_reference.npz"))
    n = 20  # two images in each of the Inception Score's 10 splits (with one each, the score is exactly 1)
    pool, logits = ref["set32_pool3"][:n].astype(np.float64), ref["set32_logits"][:n]
    # No reference statistics: a 2048-d FID of 10 images would spend half a minute in sqrtm of a singular matrix.
    with pytest.warns(UserWarning, match="singular"):
        out = fid.evaluate(ref["set32"][:n], inception=inception, batch_size=3, progress=False)
    assert out["count"] == n and out["fid"] is None
    assert _rel(out["mu"], pool.mean(axis=0)) < 1e-4 and _rel(out["sigma"], np.cov(pool, rowvar=False)) < 1e-4
    expected_is = fid.inception_score(logits)[0]  # from pytorch-fid's logits
    # The score sits close to 1 with random weights, so compare what lies above 1.
    assert expected_is > 1.0001 and abs(out["inception_score"] - expected_is) < 1e-3 * (expected_is - 1)


def test_fid_features_sharded_over_two_devices(tmp_path):
    # Two simulated CPU devices in a fresh process: 5 images at 2 per device make a full step of 4, then a step
    # holding 1 image and 3 of padding spread over both devices; the padding must be dropped, the order kept.
    weights, reference = fixture("inception_fid_random.pth"), fixture("inception_reference.npz")
    script = f"""
import warnings, numpy as np, jax, fid
assert jax.local_device_count() == 2
warnings.simplefilter("ignore")
features = fid.InceptionFeatures(fid.load_inception({weights!r}, cache_dir={str(tmp_path)!r}), 2, progress=False)
features.update(np.load({reference!r})["set32"][:5])
np.save({str(tmp_path / "logits.npy")!r}, features.result()["logits"])
"""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script], cwd=HERE, env=env, check=True, timeout=120)
    logits = np.load(tmp_path / "logits.npy")
    assert logits.shape == (5, 1008)
    assert _rel(logits, np.load(reference)["set32_logits"][:5]) < 1e-4


@pytest.mark.parametrize("name", ["set256", "set384"])
def test_fid_inception_matches_pytorch_fid(inception, name):
    ref = np.load(fixture("inception_reference.npz"))
    images = ref[name][:6]  # a subset keeps the test short on a CPU
    pool, logits = nnx.jit(lambda model, x: model(x))(inception, images)
    assert pool.shape == (len(images), 2048) and logits.shape == (len(images), 1008)
    assert _rel(pool, ref[f"{name}_pool3"][:len(images)]) < 1e-4
    assert _rel(logits, ref[f"{name}_logits"][:len(images)]) < 1e-4


def test_fid_frechet_distance_matches_pytorch_fid():
    ref = np.load(fixture("inception_reference.npz"))
    value = fid.frechet_distance(ref["mu1"], ref["sigma1"], ref["mu2"], ref["sigma2"])
    assert abs(value - ref["fid"]) / ref["fid"] < 1e-6
    with pytest.raises(ValueError, match="do not match"):
        fid.frechet_distance(ref["mu1"], ref["sigma1"], ref["mu2"][:10], ref["sigma2"][:10, :10])


def test_fid_frechet_distance_of_known_gaussians():
    # For commuting covariances the distance is ||mu1 - mu2||^2 + sum (sqrt(a_i) - sqrt(b_i))^2.
    a, b = np.array([1.0, 4.0, 9.0]), np.array([4.0, 1.0, 0.25])
    mu1, mu2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    expected = 5.0 + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert abs(fid.frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) - expected) < 1e-12


def test_fid_statistics_accumulator_equals_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(301, 16)) * rng.random(16) * 10 + 1000  # a large offset tests the numerics
    stats = fid.FeatureStats(16)
    for part in np.array_split(x, [1, 2, 50, 51, 200]):  # uneven batches, some of size 1
        stats.update(part)
    mu, sigma = stats.mu_sigma()
    assert stats.count == len(x)
    np.testing.assert_allclose(mu, x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(x, rowvar=False), rtol=1e-9, atol=1e-9)
    with pytest.warns(UserWarning, match="rank at most 4"):
        small = fid.FeatureStats(16)
        small.update(x[:5])
        small.mu_sigma()


def test_fid_inception_score_of_known_predictions():
    # Identical predictions: p(y|x) = p(y), so the KL is 0 and the score is exactly 1.
    assert fid.inception_score(np.zeros((40, 1008))) == pytest.approx((1.0, 0.0), abs=1e-12)
    # Confident predictions spread evenly over 5 classes in every split: KL = log 5, the score is 5.
    logits = 100.0 * np.eye(1008)[np.arange(50) % 5]
    mean, std = fid.inception_score(logits, splits=10)
    assert mean == pytest.approx(5.0, rel=1e-6) and std == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="at least 10 images"):
        fid.inception_score(logits[:9])


def test_fid_statistics_files(tmp_path):
    rng = np.random.default_rng(0)
    mu, sigma = rng.normal(size=8), np.cov(rng.normal(size=(20, 8)), rowvar=False)
    fid.save_statistics(str(tmp_path / "stats.npz"), mu, sigma)
    for got, want in zip(fid.load_statistics(str(tmp_path / "stats.npz")), (mu, sigma)):
        np.testing.assert_array_equal(got, want)
    # OpenAI's reference batches keep the images in arr_0 beside mu and sigma.
    np.savez(tmp_path / "openai.npz", arr_0=np.zeros((2, 4, 4, 3), np.uint8), mu=mu.astype(np.float32), sigma=sigma)
    np.testing.assert_allclose(fid.load_statistics(str(tmp_path / "openai.npz"))[0], mu, rtol=1e-6)
    np.savez(tmp_path / "images.npz", arr_0=np.zeros((2, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="not FID statistics.*fid.py stats"):
        fid.load_statistics(str(tmp_path / "images.npz"))


def test_fid_load_inception_rejects_wrong_weights(tmp_path):
    with pytest.raises(ValueError, match="not pytorch-fid's FID Inception weights.*missing.*Conv2d_1a_3x3"), \
            pytest.warns(UserWarning, match="not pytorch-fid's official"):
        fid.load_inception(fixture("dit_reference.pt"), cache_dir=str(tmp_path))
    official_name = tmp_path / fid.FID_WEIGHTS_NAME  # a damaged download under the official name
    official_name.write_bytes(b"not the weights")
    with pytest.raises(ValueError, match="sha256.*damaged"):
        fid.load_inception(str(official_name), cache_dir=str(tmp_path))


def test_fid_image_inputs_are_checked(tmp_path, inception):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(folder / "a.png")  # grayscale becomes RGB
    Image.fromarray(np.zeros((8, 6, 3), np.uint8)).save(folder / "b.png")
    images = fid.load_images(str(folder))
    assert len(images) == 2 and images[:1].shape == (1, 8, 8, 3)
    with pytest.raises(ValueError, match="b.png is 6x8.*one size"):
        images[:2]
    features = fid.InceptionFeatures(inception, progress=False)
    with pytest.raises(ValueError, match="uint8"):
        features.update(np.zeros((2, 8, 8, 3), np.float32))
    np.savez(tmp_path / "stats.npz", mu=np.zeros(3), sigma=np.eye(3))
    with pytest.raises(ValueError, match="no images"):
        fid.load_images(str(tmp_path / "stats.npz"))


def test_fid_command_line(tmp_path, monkeypatch, capsys):
    ref = np.load(fixture("inception_reference.npz"))
    monkeypatch.setenv("DIT_CACHE", str(tmp_path / "cache"))
    fid.save_statistics(str(tmp_path / "a.npz"), ref["mu1"], ref["sigma1"])
    fid.save_statistics(str(tmp_path / "b.npz"), ref["mu2"], ref["sigma2"])
    fid.main(["fid", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")])
    assert f"FID: {float(ref['fid']):.4f}" in capsys.readouterr().out
    # Statistics of a folder of PNGs (lossless) equal those of pytorch-fid's features of the same images.
    folder = tmp_path / "images"
    folder.mkdir()
    n = 7
    for i, image in enumerate(ref["set32"][:n]):
        Image.fromarray(image).save(folder / f"{i}.png")
    with pytest.warns(UserWarning):
        fid.main(["stats", str(folder), str(tmp_path / "out.npz"), "--batch-size", "3",
                  "--weights", fixture("inception_fid_random.pth")])
    mu, sigma = fid.load_statistics(str(tmp_path / "out.npz"))
    pool = ref["set32_pool3"][:n].astype(np.float64)
    assert _rel(mu, pool.mean(axis=0)) < 1e-4 and _rel(sigma, np.cov(pool, rowvar=False)) < 1e-4
