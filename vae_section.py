#################################################################################
#                                  Autoencoder                                  #
#################################################################################
# DiT never sees pixels at 256x256: it models the 32x32x4 latents of the Stable Diffusion VAE
# (AutoencoderKL "kl-f8", released as stabilityai/sd-vae-ft-ema and sd-vae-ft-mse). Below is that
# autoencoder written layer for layer as diffusers 0.42 builds it (diffusers/models/autoencoders/vae.py,
# unets/unet_2d_blocks.py, resnet.py, attention_processor.py), in NHWC, with a loader for the released
# weights that needs neither torch nor the safetensors package.

import dataclasses
import http.client
import json
import os
import re
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from fid import load_torch


def center_crop_arr(pil_image, image_size):
    """Centre crop as ADM/DiT do (guided-diffusion image_datasets.py, used by DiT's train.py): halve with a
    BOX filter while the short side is at least twice the target (cheap and alias-free), BICUBIC-resize so
    the short side equals image_size, then cut the central square. Returns uint8 (S, S, 3)."""
    if not (isinstance(image_size, (int, np.integer)) and image_size > 0):
        raise ValueError(f"image_size must be a positive int, got {image_size!r}")
    # DiT's ImageFolder loader converts to RGB before cropping; doing it first also keeps PIL from
    # silently using NEAREST on palette ("P") images.
    if pil_image.mode != "RGB":
        pil_image = pil_image.convert("RGB")
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.asarray(pil_image)  # (H, W, 3), short side == image_size
    top = (arr.shape[0] - image_size) // 2
    left = (arr.shape[1] - image_size) // 2
    return arr[top:top + image_size, left:left + image_size]


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """The fields of diffusers' AutoencoderKL config.json that shape the network; the defaults are the SD VAE."""
    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    latent_channels: int = 4
    scaling_factor: float = 0.18215  # DiT multiplies latents by this so they have roughly unit variance

    @classmethod
    def from_json(cls, path):
        """Read a diffusers config.json; keys that do not change the network (sample_size, ...) are ignored,
        but options this implementation does not build are refused rather than silently ignored."""
        with open(path) as f:
            raw = json.load(f)
        if raw.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
            raise ValueError(f"{path}: _class_name is {raw['_class_name']!r}, expected 'AutoencoderKL'")
        required = {"act_fn": "silu", "use_quant_conv": True, "use_post_quant_conv": True,
                    "mid_block_add_attention": True, "shift_factor": None, "latents_mean": None}
        for key, want in required.items():
            if raw.get(key, want) != want:
                raise ValueError(f"{path}: {key}={raw[key]!r} is not supported (only {want!r}, as in the SD VAE)")
        for key, want in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
            if any(t != want for t in raw.get(key, [want])):
                raise ValueError(f"{path}: {key}={raw[key]} is not supported (only {want})")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in raw.items() if k in fields}
        if "block_out_channels" in kw:
            kw["block_out_channels"] = tuple(kw["block_out_channels"])
        return cls(**kw)

    def __post_init__(self):
        if not self.block_out_channels or any(c % self.norm_num_groups for c in self.block_out_channels):
            raise ValueError(f"block_out_channels {self.block_out_channels} must be non-empty multiples of "
                             f"norm_num_groups={self.norm_num_groups} (GroupNorm splits the channels into groups)")


def _group_norm(channels, groups, rngs):
    # two-pass variance like torch's GroupNorm; the one-pass E[x^2]-E[x]^2 loses digits on large activations
    return nnx.GroupNorm(channels, num_groups=groups, epsilon=1e-6, use_fast_variance=False, rngs=rngs)


class VAEResnetBlock(nnx.Module):
    """diffusers ResnetBlock2D without a time embedding: GroupNorm-SiLU-conv twice, plus a 1x1 shortcut
    when the channel count changes."""

    def __init__(self, cin, cout, groups, *, rngs):
        self.norm1 = _group_norm(cin, groups, rngs)
        self.conv1 = nnx.Conv(cin, cout, (3, 3), padding=1, rngs=rngs)
        self.norm2 = _group_norm(cout, groups, rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), padding=1, rngs=rngs)
        self.conv_shortcut = nnx.Conv(cin, cout, (1, 1), rngs=rngs) if cin != cout else None

    def __call__(self, x):  # (B, H, W, cin) -> (B, H, W, cout)
        h = self.conv1(nnx.silu(self.norm1(x)))
        h = self.conv2(nnx.silu(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + h


class VAEAttention(nnx.Module):
    """The mid-block self-attention over all H*W positions: one head as wide as the channels, GroupNorm in
    front, residual around it (diffusers Attention with AttnProcessor2_0, heads = 1)."""

    def __init__(self, channels, groups, *, rngs):
        self.group_norm = _group_norm(channels, groups, rngs)
        self.to_q = nnx.Linear(channels, channels, rngs=rngs)
        self.to_k = nnx.Linear(channels, channels, rngs=rngs)
        self.to_v = nnx.Linear(channels, channels, rngs=rngs)
        self.to_out = nnx.Linear(channels, channels, rngs=rngs)

    def __call__(self, x):  # (B, H, W, C)
        B, H, W, C = x.shape
        h = self.group_norm(x).reshape(B, H * W, C)
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)  # (B, HW, C) each
        weights = jax.nn.softmax(jnp.einsum("bqc,bkc->bqk", q, k) / np.sqrt(C), axis=-1)  # (B, HW, HW)
        out = self.to_out(jnp.einsum("bqk,bkc->bqc", weights, v))
        return x + out.reshape(B, H, W, C)


class VAEDownsample(nnx.Module):
    """Stride-2 3x3 conv. diffusers pads (left 0, right 1, top 0, bottom 1) instead of symmetrically, a
    quirk inherited from the original LDM code; the weights were trained with it."""

    def __init__(self, channels, *, rngs):
        self.conv = nnx.Conv(channels, channels, (3, 3), strides=2, padding=((0, 1), (0, 1)), rngs=rngs)

    def __call__(self, x):  # (B, H, W, C) -> (B, H/2, W/2, C)
        return self.conv(x)


class VAEUpsample(nnx.Module):
    """Nearest-neighbour x2 then a 3x3 conv (diffusers Upsample2D with use_conv=True)."""

    def __init__(self, channels, *, rngs):
        self.conv = nnx.Conv(channels, channels, (3, 3), padding=1, rngs=rngs)

    def __call__(self, x):  # (B, H, W, C) -> (B, 2H, 2W, C)
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return self.conv(x)


class DownEncoderBlock(nnx.Module):
    """diffusers DownEncoderBlock2D: `n` ResnetBlocks, then a downsampling conv except in the last block. The
    one-element list mirrors diffusers' name `downsamplers.0`, which keeps weight loading a name mapping."""

    def __init__(self, cin, cout, n, groups, downsample, *, rngs):
        self.resnets = nnx.List([VAEResnetBlock(cout if i else cin, cout, groups, rngs=rngs) for i in range(n)])
        self.downsamplers = nnx.List([VAEDownsample(cout, rngs=rngs)] if downsample else [])

    def __call__(self, x):
        for block in [*self.resnets, *self.downsamplers]:
            x = block(x)
        return x


class UpDecoderBlock(nnx.Module):
    """diffusers UpDecoderBlock2D: `n` ResnetBlocks, then an upsampling step except in the last block."""

    def __init__(self, cin, cout, n, groups, upsample, *, rngs):
        self.resnets = nnx.List([VAEResnetBlock(cout if i else cin, cout, groups, rngs=rngs) for i in range(n)])
        self.upsamplers = nnx.List([VAEUpsample(cout, rngs=rngs)] if upsample else [])

    def __call__(self, x):
        for block in [*self.resnets, *self.upsamplers]:
            x = block(x)
        return x


class VAEMidBlock(nnx.Module):
    """diffusers UNetMidBlock2D at the lowest resolution: ResnetBlock, attention, ResnetBlock."""

    def __init__(self, channels, groups, *, rngs):
        self.resnets = nnx.List([VAEResnetBlock(channels, channels, groups, rngs=rngs) for _ in range(2)])
        self.attentions = nnx.List([VAEAttention(channels, groups, rngs=rngs)])

    def __call__(self, x):
        x = self.resnets[0](x)
        x = self.attentions[0](x)
        return self.resnets[1](x)


class VAEEncoder(nnx.Module):
    """Image (B, H, W, in) -> moments (B, H/f, W/f, 2*latent) with f = 2**(len(block_out_channels) - 1):
    every block but the last halves the resolution."""

    def __init__(self, cfg, *, rngs):
        ch, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = nnx.Conv(cfg.in_channels, ch[0], (3, 3), padding=1, rngs=rngs)
        self.down_blocks = nnx.List([
            DownEncoderBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, g, i < len(ch) - 1, rngs=rngs)
            for i in range(len(ch))])
        self.mid_block = VAEMidBlock(ch[-1], g, rngs=rngs)
        self.conv_norm_out = _group_norm(ch[-1], g, rngs)
        self.conv_out = nnx.Conv(ch[-1], 2 * cfg.latent_channels, (3, 3), padding=1, rngs=rngs)

    def __call__(self, x):
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(nnx.silu(self.conv_norm_out(x)))


class VAEDecoder(nnx.Module):
    """Latent (B, h, w, latent) -> image (B, h*f, w*f, out); the encoder's mirror image, with one more
    ResnetBlock per level (layers_per_block + 1, as diffusers builds it)."""

    def __init__(self, cfg, *, rngs):
        ch, g = cfg.block_out_channels[::-1], cfg.norm_num_groups
        self.conv_in = nnx.Conv(cfg.latent_channels, ch[0], (3, 3), padding=1, rngs=rngs)
        self.mid_block = VAEMidBlock(ch[0], g, rngs=rngs)
        self.up_blocks = nnx.List([
            UpDecoderBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block + 1, g, i < len(ch) - 1, rngs=rngs)
            for i in range(len(ch))])
        self.conv_norm_out = _group_norm(ch[-1], g, rngs)
        self.conv_out = nnx.Conv(ch[-1], cfg.out_channels, (3, 3), padding=1, rngs=rngs)

    def __call__(self, z):
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(nnx.silu(self.conv_norm_out(x)))


class AutoencoderKL(nnx.Module):
    """diffusers AutoencoderKL in NHWC. encode gives the diagonal Gaussian posterior (mean, logvar); DiT
    trains on z = (mean + exp(logvar / 2) * eps) * scaling_factor and samples decode(z / scaling_factor)."""

    def __init__(self, cfg: VAEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder = VAEEncoder(cfg, rngs=rngs)
        self.decoder = VAEDecoder(cfg, rngs=rngs)
        self.quant_conv = nnx.Conv(2 * cfg.latent_channels, 2 * cfg.latent_channels, (1, 1), rngs=rngs)
        self.post_quant_conv = nnx.Conv(cfg.latent_channels, cfg.latent_channels, (1, 1), rngs=rngs)

    def _check(self, x, channels, what):
        if x.ndim != 4 or x.shape[-1] != channels:
            raise ValueError(f"AutoencoderKL.{what} expects NHWC input with {channels} channels, got shape "
                             f"{tuple(x.shape)}; for NCHW arrays pass x.transpose(0, 2, 3, 1)")

    def encode(self, x):
        """x: (B, H, W, in) in [-1, 1] -> mean, logvar: (B, H/f, W/f, latent) each."""
        self._check(x, self.cfg.in_channels, "encode")
        moments = self.quant_conv(self.encoder(x))
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)  # the clamp diffusers' DiagonalGaussianDistribution applies

    def decode(self, z):
        """z: (B, h, w, latent), unscaled -> image (B, h*f, w*f, out), roughly in [-1, 1]."""
        self._check(z, self.cfg.latent_channels, "decode")
        return self.decoder(self.post_quant_conv(z))


#################################################################################
#                           Loading the released VAE                            #
#################################################################################

SD_VAE_URL = "https://huggingface.co/stabilityai/sd-vae-ft-{}/resolve/main/{}"
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}


def read_safetensors(path):
    """Read a .safetensors file with numpy: 8-byte little-endian header length, a JSON header mapping each
    name to {dtype, shape, data_offsets}, then the raw little-endian bytes. BF16 comes back as float32."""
    def bad(problem):
        return ValueError(f"{path} is not a readable safetensors file: {problem}. If it was downloaded, the "
                          f"download may be incomplete; delete it and fetch it again.")
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise bad(f"only {len(blob)} bytes")
    n = int.from_bytes(blob[:8], "little")
    if n > len(blob) - 8:
        raise bad(f"the header claims {n} bytes but the file has {len(blob) - 8} after the length field")
    try:
        header = json.loads(blob[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    header.pop("__metadata__", None)
    data = memoryview(blob)[8 + n:]
    tensors = {}
    for name, info in header.items():
        try:
            dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<")
            shape, (begin, end) = tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"entry {name!r} is malformed or has an unsupported dtype ({e!r})") from None
        if not 0 <= begin <= end <= len(data):
            raise bad(f"tensor {name!r} spans bytes {begin}..{end} but the data has {len(data)} bytes")
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise bad(f"tensor {name!r} has {end - begin} bytes, not what shape {list(shape)} of {info['dtype']} needs")
        arr = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
        if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = arr.astype(arr.dtype.newbyteorder("="))
    return tensors


def vae_torch_names(model):
    """Map every parameter of our AutoencoderKL to its diffusers name: {torch name: (our path, torch shape)}.
    Our module tree mirrors diffusers', so only leaf names and layouts differ: conv kernels are HWIO here and
    OIHW in PyTorch, linear kernels (in, out) here and (out, in) there, GroupNorm's scale is torch's weight."""
    names = {}
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        *mods, leaf = (str(p) for p in path)
        shape = tuple(var.shape)
        if leaf == "kernel":
            shape = shape[::-1] if len(shape) == 2 else (shape[3], shape[2], shape[0], shape[1])
        if mods[-1] == "to_out":
            mods.append("0")  # diffusers' to_out is ModuleList([Linear, Dropout])
        names[".".join(mods + ["bias" if leaf == "bias" else "weight"])] = (path, shape)
    return names


_OLD_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def load_vae_weights(model, tensors, source="the weight file"):
    """Copy a diffusers state dict (numpy arrays, either attention naming) into `model`, converting layouts.
    Every parameter must be present and every tensor used; a mismatch names the offending keys."""
    tensors = {re.sub(r"(attentions\.\d+\.)(query|key|value|proj_attn)\.",
                      lambda m: m.group(1) + _OLD_ATTENTION[m.group(2)] + ".", k): v for k, v in tensors.items()}
    expected = vae_torch_names(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        show = lambda keys: f"{len(keys)} {keys[:6]}{' ...' if len(keys) > 6 else ''}"
        raise ValueError(f"{source} does not fit the VAE of {model.cfg}: missing keys {show(missing)}, unexpected "
                         f"keys {show(unexpected)}. Is config.json the one that came with these weights?")
    variables = dict(nnx.iter_graph(model))
    for name, (path, shape) in expected.items():
        w = np.asarray(tensors[name], dtype=np.float32)
        if w.ndim == 4 and len(shape) == 2 and w.shape[2:] == (1, 1):
            w = w[:, :, 0, 0]  # old checkpoints stored the attention projections as 1x1 convs
        if w.shape != shape:
            raise ValueError(f"{source}: {name} has shape {list(w.shape)}, the model expects {list(shape)}")
        if w.ndim == 4:
            w = w.transpose(2, 3, 1, 0)  # OIHW -> HWIO
        elif w.ndim == 2:
            w = w.T  # (out, in) -> (in, out)
        variables[path].set_value(jnp.asarray(w))
    return model


def _download(url, dest):
    """Fetch url to dest through a temporary file, so an interrupted download never looks complete."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    print(f"downloading {url} -> {dest}")
    tmp = dest + ".part"
    with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
        while chunk := r.read(1 << 20):
            f.write(chunk)
    os.replace(tmp, dest)


def load_vae(source="ema", cache_dir=None):
    """Build the AutoencoderKL with released weights. `source`: "ema" or "mse" (stabilityai/sd-vae-ft-ema
    or -mse, downloaded into `cache_dir`, default $DIT_CACHE or ~/.cache/dit-jax, when missing), a diffusers
    folder (config.json + diffusion_pytorch_model.safetensors or .bin), or a weight file (a config.json beside
    it is used when present, else the SD VAE's configuration)."""
    if source in ("ema", "mse"):
        cache_dir = cache_dir or os.environ.get("DIT_CACHE") or os.path.expanduser("~/.cache/dit-jax")
        folder = os.path.join(cache_dir, f"sd-vae-ft-{source}")
        for fname in ("config.json", "diffusion_pytorch_model.safetensors"):
            dest = os.path.join(folder, fname)
            if not os.path.exists(dest):
                try:
                    _download(SD_VAE_URL.format(source, fname), dest)
                except (OSError, http.client.HTTPException) as e:
                    raise RuntimeError(
                        f"cannot download {SD_VAE_URL.format(source, fname)} ({e}). Download config.json and "
                        f"diffusion_pytorch_model.safetensors of stabilityai/sd-vae-ft-{source} by hand into "
                        f"{folder}, or pass the folder or weight file as the VAE source.") from None
        source = folder
    if os.path.isdir(source):
        candidates = [os.path.join(source, f"diffusion_pytorch_model.{ext}") for ext in ("safetensors", "bin")]
        found = [p for p in candidates if os.path.exists(p)]
        if not found:
            raise FileNotFoundError(f"{source} holds neither diffusion_pytorch_model.safetensors nor .bin; "
                                    f"put the VAE weights there or pass the weight file itself")
        weights, folder = found[0], source
    elif os.path.isfile(source):
        weights, folder = source, os.path.dirname(source)
    else:
        raise FileNotFoundError(f"VAE source {source!r} is not 'ema', 'mse', an existing folder or a weight file")
    config_path = os.path.join(folder, "config.json")
    cfg = VAEConfig.from_json(config_path) if os.path.exists(config_path) else VAEConfig()
    if weights.endswith(".safetensors"):
        tensors = read_safetensors(weights)
    else:
        tensors = load_torch(weights)
        if not (isinstance(tensors, dict) and all(isinstance(v, np.ndarray) for v in tensors.values())):
            raise ValueError(f"{weights} does not hold a plain state dict of tensors, as diffusers saves it")
    # build without random initialisation: every parameter is overwritten by the file anyway
    model = nnx.eval_shape(lambda: AutoencoderKL(cfg, rngs=nnx.Rngs(0)))
    return load_vae_weights(model, tensors, source=weights)
