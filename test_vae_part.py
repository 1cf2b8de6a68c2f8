"""Tests of the Stable Diffusion VAE (dit.py) and prepare_imagenet100.py against diffusers' outputs."""
import io
import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx
from PIL import Image

import fid
import prepare_imagenet100
from dit import (AutoencoderKL, VAEConfig, center_crop_arr, load_vae, load_vae_weights, read_safetensors,
                         vae_torch_names)

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


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(ours - ref) / np.linalg.norm(ref)


def nhwc(a):
    return np.asarray(a).transpose(0, 2, 3, 1)


#################################################################################
#                                  Autoencoder                                  #
#################################################################################

def test_vae_matches_diffusers():
    """Posterior mean, log-variance and decode(mean) of the small random VAE equal diffusers' (README: 1e-5)."""
    ref = np.load(fixture("vae_reference.npz"))
    vae = load_vae(fixture("vae_reference"))
    assert vae.cfg == VAEConfig.from_json(os.path.join(fixture("vae_reference"), "config.json"))
    mean, logvar = vae.encode(nhwc(ref["x"]))
    assert mean.shape == nhwc(ref["mean"]).shape
    assert rel_err(mean, nhwc(ref["mean"])) < 1e-5
    assert rel_err(logvar, nhwc(ref["logvar"])) < 1e-5
    assert rel_err(vae.decode(nhwc(ref["mean"])), nhwc(ref["decoded"])) < 1e-5


def test_vae_full_size_keys_and_shapes():
    """The default (SD kl-f8) configuration has exactly the parameters of the released VAE, as named by diffusers."""
    vae = nnx.eval_shape(lambda: AutoencoderKL(VAEConfig(), rngs=nnx.Rngs(0)))
    ours = {name: list(shape) for name, (_, shape) in vae_torch_names(vae).items()}
    with open(fixture("sd_vae_keys.json")) as f:
        ref = json.load(f)
    assert sorted(set(ours) ^ set(ref)) == []
    assert ours == ref
    n_params = sum(int(np.prod(v.shape)) for _, v in nnx.iter_graph(vae) if isinstance(v, nnx.Param))
    assert n_params == sum(int(np.prod(s)) for s in ref.values())


def test_vae_old_attention_names_load():
    """Older checkpoints name the attention query/key/value/proj_attn and may store them as 1x1 convs."""
    folder = fixture("vae_reference")
    new = read_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    renames = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    old = {}
    for k, v in new.items():
        for a, b in renames.items():
            if f".{a}." in k:
                k = k.replace(f".{a}.", f".{b}.")
                v = v[:, :, None, None] if v.ndim == 2 else v
        old[k] = v
    assert any(".proj_attn.weight" in k for k in old) and not any(".to_q." in k for k in old)
    cfg = VAEConfig.from_json(os.path.join(folder, "config.json"))
    vae = load_vae_weights(nnx.eval_shape(lambda: AutoencoderKL(cfg, rngs=nnx.Rngs(0))), old)
    ref = np.load(fixture("vae_reference.npz"))
    assert rel_err(vae.encode(nhwc(ref["x"]))[0], nhwc(ref["mean"])) < 1e-5


def test_vae_key_mismatch_is_named():
    folder = fixture("vae_reference")
    tensors = read_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    cfg = VAEConfig.from_json(os.path.join(folder, "config.json"))
    tensors["encoder.extra.weight"] = tensors.pop("decoder.conv_out.bias")
    named = r"missing keys 1 \['decoder\.conv_out\.bias'\], unexpected keys 1 \['encoder\.extra\.weight'\]"
    with pytest.raises(ValueError, match=named):
        load_vae_weights(nnx.eval_shape(lambda: AutoencoderKL(cfg, rngs=nnx.Rngs(0))), tensors)


def test_safetensors_dtypes_and_truncation(tmp_path):
    """Hand-built file: the header layout of the safetensors spec, F16/BF16/I64 data; truncation -> clear error."""
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    bf16 = (f32.view(np.uint32) >> 16).astype("<u2")  # these values are exact in bfloat16
    parts = {"a": ("F16", f32.astype("<f2")), "b": ("BF16", bf16), "c": ("I64", np.array([7, -1], "<i8"))}
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, (dt, arr) in parts.items():
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        blobs.append(arr.tobytes())
    head = json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    got = read_safetensors(str(path))
    np.testing.assert_array_equal(got["a"], f32)
    np.testing.assert_array_equal(got["b"], f32)
    assert got["b"].dtype == np.float32
    np.testing.assert_array_equal(got["c"], [7, -1])

    real = open(os.path.join(fixture("vae_reference"), "diffusion_pytorch_model.safetensors"), "rb").read()
    for name, blob in [("cut.safetensors", real[:len(real) // 2]), ("short.safetensors", real[:5]),
                       ("head.safetensors", real[:200]), ("text.safetensors", b"<html>not found</html>")]:
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ValueError, match="not a readable safetensors file"):
            read_safetensors(str(tmp_path / name))
    shutil.copy(os.path.join(fixture("vae_reference"), "config.json"), tmp_path / "config.json")
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(real[:len(real) - 10])
    with pytest.raises(ValueError, match="incomplete"):
        load_vae(str(tmp_path))


def test_load_vae_bad_sources(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="neither diffusion_pytorch_model.safetensors nor .bin"):
        load_vae(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not 'ema', 'mse'"):
        load_vae(str(tmp_path / "nope.safetensors"))

    def offline(url, timeout=None):
        raise OSError("network is unreachable")
    monkeypatch.setattr("urllib.request.urlopen", offline)
    with pytest.raises(RuntimeError, match="by hand into"):
        load_vae("ema", cache_dir=str(tmp_path / "cache"))
    assert not any(p.name.endswith(".part") or p.is_file() for p in (tmp_path / "cache").rglob("*"))


def test_load_vae_ema_downloads_into_cache(tmp_path, monkeypatch):
    """"ema" fetches config.json and the safetensors file once (here served from the fixture), then reads the cache."""
    folder, fetched = fixture("vae_reference"), []

    class Response(io.BytesIO):
        headers = {}

    def fake_urlopen(url, timeout=None):
        fetched.append(url)
        assert url.startswith("https://huggingface.co/stabilityai/sd-vae-ft-ema/resolve/main/")
        return Response(open(os.path.join(folder, url.rsplit("/", 1)[1]), "rb").read())
    monkeypatch.setattr("urllib.request.urlopen", fake_urlopen)
    monkeypatch.setenv("DIT_CACHE", str(tmp_path))
    ref = np.load(fixture("vae_reference.npz"))
    for _ in range(2):
        vae = load_vae("ema")
        assert rel_err(vae.encode(nhwc(ref["x"]))[0], nhwc(ref["mean"])) < 1e-5
    assert len(fetched) == 2  # the second load came from the cache
    assert sorted(os.listdir(tmp_path / "sd-vae-ft-ema")) == ["config.json", "diffusion_pytorch_model.safetensors"]


def test_load_vae_bin_goes_through_torch_reader(tmp_path):
    """A .bin state dict is read with fid.load_torch; one of the wrong model (DiT's) is refused by key names."""
    shutil.copy(os.path.join(fixture("vae_reference"), "config.json"), tmp_path / "config.json")
    shutil.copy(fixture("dit_reference.pt"), tmp_path / "diffusion_pytorch_model.bin")
    named = r"missing keys \d+ \['decoder\.conv_in\.bias'.*unexpected keys \d+ \['blocks\.0\."
    with pytest.raises(ValueError, match=named):
        load_vae(str(tmp_path))


def test_vae_config_from_json(tmp_path):
    cfg = VAEConfig.from_json(os.path.join(fixture("vae_reference"), "config.json"))
    assert cfg.block_out_channels == (32, 64) and cfg.norm_num_groups == 16 and cfg.scaling_factor == 0.18215
    raw = json.load(open(os.path.join(fixture("vae_reference"), "config.json")))
    (tmp_path / "c.json").write_text(json.dumps({**raw, "up_block_types": ["AttnUpDecoderBlock2D"] * 2}))
    with pytest.raises(ValueError, match="up_block_types"):
        VAEConfig.from_json(str(tmp_path / "c.json"))


def test_vae_rejects_nchw():
    vae = load_vae(fixture("vae_reference"))
    with pytest.raises(ValueError, match="NHWC"):
        vae.encode(np.zeros((1, 3, 16, 16), np.float32))


#################################################################################
#                                  Centre crop                                  #
#################################################################################

def test_center_crop_arr_against_manual_adm_steps():
    """ADM's recipe done by hand: BOX-halve 1000x600 while the short side is >= 2*64, bicubic, centre crop."""
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (600, 1000, 3), dtype=np.uint8))
    out = center_crop_arr(img, 64)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    # 600 -> 300 -> 150 -> 75 (75 < 128 stops), then bicubic to short side 64: (1000/8=125) * 64/75 = 106.67 -> 107
    ref = img.resize((500, 300), Image.BOX).resize((250, 150), Image.BOX).resize((125, 75), Image.BOX)
    ref = np.asarray(ref.resize((107, 64), Image.BICUBIC))[:, (107 - 64) // 2:(107 - 64) // 2 + 64]
    np.testing.assert_array_equal(out, ref)
    # grayscale and palette images come back as RGB
    assert center_crop_arr(img.convert("L"), 32).shape == (32, 32, 3)
    assert center_crop_arr(img.convert("P"), 32).shape == (32, 32, 3)


#################################################################################
#                             prepare_imagenet100.py                            #
#################################################################################

def kaggle_tree(root, photos):
    """A small tree in the Kaggle layout from real photos, with the kinds of damage real downloads have."""
    wnids = sorted(f[:-5] for f in os.listdir(photos) if f.endswith(".JPEG"))
    gray = "n03764736"  # a grayscale photo, per the data README
    a, b, c, d = [w for w in wnids if w != gray][:4]
    src = root / "src"
    for folder in ("train.X1/" + a, "train.X1/" + b, "train.X2/" + c, "train.X2/" + d, "val.X/" + a, "val.X/" + c):
        (src / folder).mkdir(parents=True)
    photo = lambda w: os.path.join(photos, w + ".JPEG")
    shutil.copy(photo(a), src / "train.X1" / a / "1.JPEG")
    shutil.copy(photo(b), src / "train.X1" / a / "2.JPEG")
    Image.open(photo(b)).convert("CMYK").save(src / "train.X1" / b / "cmyk.JPEG")
    shutil.copy(photo(gray), src / "train.X2" / c / "gray.JPEG")
    Image.open(photo(c)).convert("RGBA").save(src / "train.X2" / c / "png.JPEG", format="PNG")
    blob = open(photo(d), "rb").read()
    (src / "train.X2" / c / "truncated.JPEG").write_bytes(blob[:len(blob) // 2])
    shutil.copy(photo(a), src / "val.X" / a / "v.JPEG")
    shutil.copy(photo(c), src / "val.X" / c / "v.JPEG")
    labels = json.load(open(os.path.join(photos, "Labels.json")))
    (src / "Labels.json").write_text(json.dumps({w: labels[w] for w in (a, b, c, d)}))
    # d stays empty; files in label order: a/1, a/2, b/cmyk, c/gray, c/png, c/truncated
    return src, [a, b, c, d], labels


def test_prepare_latents_kaggle_tree(tmp_path):
    src, wnids, names = kaggle_tree(tmp_path, data("imagenet100-photos"))
    vae_dir = fixture("vae_reference")
    out = tmp_path / "out"
    args = [str(src), str(out), "--vae", vae_dir, "--resolution", "32", "--chunk-size", "2", "--batch-size", "2",
            "--workers", "2", "--no-fid"]
    manifest = prepare_imagenet100.main(args)

    latents, labels = np.load(out / "latents.npy", mmap_mode="r"), np.load(out / "labels.npy")
    kept = [("train.X1", 0, "1.JPEG"), ("train.X1", 0, "2.JPEG"), ("train.X1", 1, "cmyk.JPEG"),
            ("train.X2", 2, "gray.JPEG"), ("train.X2", 2, "png.JPEG")]
    vae = load_vae(vae_dir)
    assert latents.dtype == np.float16 and latents.shape == (5, 2, 16, 16, 2 * vae.cfg.latent_channels)
    assert labels.dtype == np.int64 and labels.tolist() == [k[1] for k in kept]
    crops = np.stack([center_crop_arr(Image.open(src / split / wnids[label] / f), 32) for split, label, f in kept])
    x = crops.astype(np.float32) / 127.5 - 1
    mean, logvar = nnx.jit(lambda vae, x: vae.encode(x))(vae, np.concatenate([x, x[:, :, ::-1]]))
    for flip in (0, 1):
        rows = slice(5 * flip, 5 * flip + 5)
        assert rel_err(latents[:, flip, ..., :4], mean[rows]) < 1e-3  # float16 storage
        assert rel_err(latents[:, flip, ..., 4:], np.exp(0.5 * np.asarray(logvar[rows]))) < 1e-3
    assert not np.allclose(latents[:, 0], latents[:, 1], atol=1e-2)  # the flip is really a different image

    assert [s["file"] for s in manifest["skipped"]] == [os.path.join("train.X2", wnids[2], "truncated.JPEG")]
    assert "truncated" in manifest["skipped"][0]["reason"]
    assert any(wnids[3] in w and "no images" in w for w in manifest["warnings"])
    assert any("126689" in w for w in manifest["warnings"])
    assert manifest["scaling_factor"] == 0.18215 and manifest["complete"]
    saved = json.load(open(out / "manifest.json"))
    assert saved["counts"]["images"] == 5 and saved["shape"] == list(latents.shape)
    assert json.load(open(out / "classes.json")) == [{"wnid": w, "name": names[w]} for w in wnids]
    assert not (out / "latents.partial.npy").exists()

    # val goes into out/val with the training split's labels
    prepare_imagenet100.main(args + ["--split", "val"])
    assert np.load(out / "val" / "labels.npy").tolist() == [0, 2]
    assert np.load(out / "val" / "latents.npy").shape == (2, 2, 16, 16, 8)


def test_prepare_resumes_without_redoing_chunks(tmp_path, monkeypatch):
    src, wnids, _ = kaggle_tree(tmp_path, data("imagenet100-photos"))
    args = lambda out: [str(src), str(out), "--pixels", "16", "--chunk-size", "2", "--batch-size", "2",
                        "--workers", "1", "--no-fid"]
    prepare_imagenet100.main(args(tmp_path / "whole"))

    real, calls = prepare_imagenet100.load_image, []

    def failing(path, size):  # the 5th image read dies, as if the machine went down in chunk 2 (files 4-5)
        calls.append(os.path.relpath(path, src))
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(path, size)
    monkeypatch.setattr(prepare_imagenet100, "load_image", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare_imagenet100.main(args(tmp_path / "out"))
    done = json.load(open(tmp_path / "out" / "manifest.json"))["chunks_done"]
    assert sorted(done) == ["0", "1"] and not (tmp_path / "out" / "images.npy").exists()

    calls.clear()
    monkeypatch.setattr(prepare_imagenet100, "load_image", lambda p, s: (calls.append(p), real(p, s))[1])
    manifest = prepare_imagenet100.main(args(tmp_path / "out"))
    assert len(calls) == 2  # only chunk 2 (the last two files) was read again
    assert sorted(manifest["chunks_done"]) == ["0", "1", "2"] and manifest["counts"]["images"] == 5
    for name in ("images.npy", "labels.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "out" / name), np.load(tmp_path / "whole" / name))
    images = np.load(tmp_path / "out" / "images.npy")
    assert images.dtype == np.uint8 and images.shape == (5, 16, 16, 3)
    np.testing.assert_array_equal(images[2], center_crop_arr(Image.open(src / "train.X1" / wnids[1] / "cmyk.JPEG"), 16))
    calls.clear()
    assert prepare_imagenet100.main(args(tmp_path / "out"))["complete"] and calls == []  # finished: nothing redone


def test_prepare_fid_statistics(tmp_path, monkeypatch):
    """fid_stats.npz holds the mean and covariance of the Inception pool features of the kept, cropped images."""
    monkeypatch.setenv("DIT_CACHE", str(tmp_path / "cache"))  # fid.py caches converted weights there
    src, wnids, _ = kaggle_tree(tmp_path, data("imagenet100-photos"))
    weights = fixture("inception_fid_random.pth")
    with pytest.warns(UserWarning):  # the random fixture is not the official file; 5 images give a singular covariance
        prepare_imagenet100.main([str(src), str(tmp_path / "out"), "--pixels", "16", "--chunk-size", "4",
                                  "--batch-size", "3", "--workers", "2", "--inception", weights])
    stats = np.load(tmp_path / "out" / "fid_stats.npz")
    images = np.load(tmp_path / "out" / "images.npy")
    with pytest.warns(UserWarning, match="not pytorch-fid's official"):
        inception = fid.load_inception(weights)
    pool3 = np.asarray(nnx.jit(lambda net, x: net(x)[0])(inception, images), np.float64)
    assert rel_err(stats["mu"], pool3.mean(0)) < 1e-5
    assert rel_err(stats["sigma"], np.cov(pool3, rowvar=False)) < 1e-4
    assert not (tmp_path / "out" / "inception.partial.npy").exists()
