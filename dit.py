"""Diffusion Transformers (DiT) in JAX: model, objectives, autoencoder, data, training, sampling, evaluation.

One file, read from top to bottom in the order the data flows:

    configuration -> model -> objectives and samplers -> autoencoder -> data -> training
    -> sampling and evaluation -> command line

Paper: "Scalable Diffusion Models with Transformers", W. Peebles and S. Xie, ICCV 2023
(arXiv:2212.09748). Official PyTorch code: github.com/facebookresearch/DiT. On the same weights and
inputs this file gives the official numbers (see test_dit.py and the fixtures it reads).

Run `python dit.py --help`, or from a notebook `import dit; dit.main(["--size", "S", ...])`.
"""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fid import load_torch

#################################################################################
#                                 Configuration                                 #
#################################################################################

# Hidden size, depth and heads of the four model sizes of Table 1 in the paper. With patch size 2,
# 4 or 8 they give the twelve official configurations (DiT-S/2 ... DiT-XL/8).
DIT_SIZES = {
    "S": dict(hidden_size=384, depth=12, num_heads=6),
    "B": dict(hidden_size=768, depth=12, num_heads=12),
    "L": dict(hidden_size=1024, depth=24, num_heads=16),
    "XL": dict(hidden_size=1152, depth=28, num_heads=16),
}


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    """Architecture of a DiT. The defaults are DiT-XL/2 on 256x256 images (32x32x4 latents)."""
    input_size: int | tuple[int, int] = 32  # latent (or pixel) height and width; an int means square
    patch_size: int = 2
    in_channels: int = 4
    hidden_size: int = 1152
    depth: int = 28
    num_heads: int = 16
    mlp_ratio: float = 4.0
    class_dropout_prob: float = 0.1  # > 0 adds the null label that classifier-free guidance needs
    num_classes: int = 1000          # 0 trains an unconditional model
    learn_sigma: bool = True         # DDPM with learned variance doubles the output channels

    @property
    def grid(self):
        """Number of patches along height and width."""
        h, w = (self.input_size, self.input_size) if isinstance(self.input_size, int) else self.input_size
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"input size {h}x{w} is not divisible by the patch size {self.patch_size}")
        return h // self.patch_size, w // self.patch_size

    @property
    def out_channels(self):
        return 2 * self.in_channels if self.learn_sigma else self.in_channels


def dit_config(name, **overrides):
    """The official configuration called `name` ('XL/2', 'S/4', ...), with fields replaced by `overrides`."""
    size, _, patch = name.partition("/")
    if size not in DIT_SIZES or patch not in ("2", "4", "8"):
        raise ValueError(f"unknown DiT configuration {name!r}; expected one of S, B, L, XL with /2, /4 or /8")
    return DiTConfig(patch_size=int(patch), **{**DIT_SIZES[size], **overrides})


#################################################################################
#                   Embedding Layers for Timesteps and Class Labels             #
#################################################################################

# The official code initialises every linear layer Xavier-uniform with zero bias, then overrides
# the embeddings with normal(0.02) and the adaLN and output layers with zeros ("adaLN-Zero").
xavier = nnx.initializers.xavier_uniform()
normal02 = nnx.initializers.normal(0.02)
zeros = nnx.initializers.zeros_init()


def modulate(x, shift, scale):
    """adaLN: scale and shift the normalised tokens x (B, T, D) per sample with (B, D) vectors."""
    return x * (1 + scale[:, None]) + shift[:, None]


def layer_norm(x, eps=1e-6):
    """LayerNorm without learnable affine parameters: adaLN supplies scale and shift instead.

    Computed in float32 whatever the compute dtype, since bfloat16 variances lose too much precision.
    """
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def timestep_embedding(t, dim, max_period=10000):
    """Sinusoidal features of (possibly fractional) timesteps t (B,) -> (B, dim), as in the official code
    (cosines first, then sines; frequencies from 1 down to 1/max_period)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def sincos_pos_embed_2d(dim, grid_h, grid_w):
    """Fixed 2-D sine-cosine position table (T, dim), T = grid_h * grid_w, row-major over the patches.

    Half of the channels encode the column and half the row (MAE's get_2d_sincos_pos_embed, which DiT
    uses; the column comes first, as the official meshgrid orders it). float64 numpy, as the official
    table is built, so that it is a constant of the compiled program.
    """
    def embed_1d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)  # (T, d/2)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    rows, cols = np.meshgrid(np.arange(grid_h, dtype=np.float64), np.arange(grid_w, dtype=np.float64), indexing="ij")
    return np.concatenate([embed_1d(dim // 2, cols), embed_1d(dim // 2, rows)], axis=1)


class TimestepEmbedder(nnx.Module):
    """Embeds scalar timesteps into vectors: sinusoidal features, then a two-layer MLP (Sec. 3.2)."""

    def __init__(self, hidden_size, freq_size=256, *, dtype, rngs):
        self.freq_size = freq_size
        self.mlp = nnx.Sequential(
            nnx.Linear(freq_size, hidden_size, kernel_init=normal02, dtype=dtype, rngs=rngs),
            nnx.silu,
            nnx.Linear(hidden_size, hidden_size, kernel_init=normal02, dtype=dtype, rngs=rngs),
        )

    def __call__(self, t):  # (B,) -> (B, D)
        return self.mlp(timestep_embedding(t, self.freq_size))


class LabelEmbedder(nnx.Module):
    """Embeds class labels into vectors. One extra row, the null label `num_classes`, stands for "no
    class": labels are dropped to it at random during training, which classifier-free guidance needs."""

    def __init__(self, num_classes, hidden_size, dropout_prob, *, rngs):
        self.num_classes, self.dropout_prob = num_classes, dropout_prob
        self.embedding_table = nnx.Embed(num_classes + (dropout_prob > 0), hidden_size,
                                         embedding_init=normal02, rngs=rngs)

    def __call__(self, labels, drop_key=None):  # (B,) -> (B, D)
        if drop_key is not None and self.dropout_prob > 0:
            drop = jax.random.uniform(drop_key, labels.shape) < self.dropout_prob
            labels = jnp.where(drop, self.num_classes, labels)
        return self.embedding_table(labels)


#################################################################################
#                                 Core DiT Model                                #
#################################################################################

class PatchEmbed(nnx.Module):
    """Patchify (Sec. 3.1): each non-overlapping p x p patch becomes one token, by a linear map that
    a p x p convolution with stride p computes."""

    def __init__(self, in_channels, hidden_size, patch_size, *, dtype, rngs):
        # Xavier over the flattened patch, as the official code computes it on the weight's 2-D view.
        init = nnx.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=(0, 1, 2), out_axis=-1)
        self.proj = nnx.Conv(in_channels, hidden_size, (patch_size, patch_size), strides=patch_size,
                             padding="VALID", kernel_init=init, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # (B, H, W, C) -> (B, T, D)
        x = self.proj(x)
        return x.reshape(x.shape[0], -1, x.shape[-1])


class Attention(nnx.Module):
    """Multi-head self-attention with a fused qkv projection (timm's Attention, which DiT uses)."""

    def __init__(self, dim, num_heads, *, dtype, rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(dim, 3 * dim, kernel_init=xavier, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, kernel_init=xavier, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # (B, T, D)
        B, T, D = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3, self.num_heads, D // self.num_heads), 3, axis=2)
        # jax picks the fused kernel for the platform (cuDNN flash attention on GPUs where it applies).
        out = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0])  # (B, T, H, D/H)
        return self.proj(out.reshape(B, T, D))


class Mlp(nnx.Module):
    """The transformer's feed-forward layer: Linear, tanh-approximated GELU, Linear."""

    def __init__(self, dim, hidden, *, dtype, rngs):
        self.fc1 = nnx.Linear(dim, hidden, kernel_init=xavier, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, kernel_init=xavier, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class DiTBlock(nnx.Module):
    """A DiT block with adaLN-Zero conditioning (Sec. 3.2, Fig. 3).

    From the conditioning vector c the block regresses a shift, a scale and a gate for both the
    attention and the MLP branch. The regression is initialised to zero, so every block starts as the
    identity function, which the paper found best among the conditioning schemes it tried.
    """

    def __init__(self, hidden_size, num_heads, mlp_ratio, *, dtype, rngs):
        self.attn = Attention(hidden_size, num_heads, dtype=dtype, rngs=rngs)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio), dtype=dtype, rngs=rngs)
        self.adaLN_modulation = nnx.Sequential(
            nnx.silu,
            nnx.Linear(hidden_size, 6 * hidden_size, kernel_init=zeros, dtype=dtype, rngs=rngs),
        )

    def __call__(self, x, c):  # x (B, T, D), c (B, D)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(self.adaLN_modulation(c), 6, -1)
        x = x + gate_msa[:, None] * self.attn(modulate(layer_norm(x), shift_msa, scale_msa))
        x = x + gate_mlp[:, None] * self.mlp(modulate(layer_norm(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nnx.Module):
    """adaLN-modulated LayerNorm and a zero-initialised linear decoder from tokens to patches."""

    def __init__(self, hidden_size, patch_size, out_channels, *, dtype, rngs):
        self.linear = nnx.Linear(hidden_size, patch_size * patch_size * out_channels, kernel_init=zeros,
                                 dtype=dtype, rngs=rngs)
        self.adaLN_modulation = nnx.Sequential(
            nnx.silu,
            nnx.Linear(hidden_size, 2 * hidden_size, kernel_init=zeros, dtype=dtype, rngs=rngs),
        )

    def __call__(self, x, c):  # x (B, T, D), c (B, D) -> (B, T, p*p*C_out)
        shift, scale = jnp.split(self.adaLN_modulation(c), 2, -1)
        return self.linear(modulate(layer_norm(x), shift, scale))


class DiT(nnx.Module):
    """Diffusion Transformer: the noised input (B, H, W, C), its timestep (B,) and its class label (B,)
    in, the predicted noise (and variance values, when learn_sigma) out, (B, H, W, C_out).

    `dtype` is the compute dtype (bfloat16 for mixed precision); parameters stay float32.
    `remat` recomputes each block's activations in the backward pass instead of storing them, which
    trades about a third more compute for the memory that large models need.
    """

    def __init__(self, cfg: DiTConfig, *, dtype=jnp.float32, remat=False, rngs: nnx.Rngs):
        self.cfg, self.dtype, self.remat = cfg, dtype, remat
        D, p = cfg.hidden_size, cfg.patch_size
        self.x_embedder = PatchEmbed(cfg.in_channels, D, p, dtype=dtype, rngs=rngs)
        self.t_embedder = TimestepEmbedder(D, dtype=dtype, rngs=rngs)
        if cfg.num_classes:
            self.y_embedder = LabelEmbedder(cfg.num_classes, D, cfg.class_dropout_prob, rngs=rngs)
        self.blocks = nnx.List([DiTBlock(D, cfg.num_heads, cfg.mlp_ratio, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(D, p, cfg.out_channels, dtype=dtype, rngs=rngs)

    def unpatchify(self, x):  # (B, T, p*p*C) -> (B, H, W, C)
        (h, w), p = self.cfg.grid, self.cfg.patch_size
        x = x.reshape(x.shape[0], h, w, p, p, -1)
        return x.transpose(0, 1, 3, 2, 4, 5).reshape(x.shape[0], h * p, w * p, -1)

    def __call__(self, x, t, y, drop_key=None):
        """x (B, H, W, C), t (B,) timesteps on the 0..1000 scale, y (B,) labels (ignored when the model is
        unconditional). `drop_key` turns on the random label dropout of training."""
        x = self.x_embedder(x.astype(self.dtype))                   # (B, T, D)
        x = x + jnp.asarray(sincos_pos_embed_2d(self.cfg.hidden_size, *self.cfg.grid), self.dtype)
        c = self.t_embedder(t)                                       # (B, D)
        if self.cfg.num_classes:
            c = c + self.y_embedder(y, drop_key)
        for block in self.blocks:
            x = nnx.remat(lambda blk, x, c: blk(x, c))(block, x, c) if self.remat else block(x, c)
        x = self.final_layer(x, c)                                   # (B, T, p*p*C_out)
        return self.unpatchify(x).astype(jnp.float32)                # (B, H, W, C_out)

    def forward_with_cfg(self, x, t, y, cfg_scale, guidance_channels=None, interval=None):
        """Classifier-free guidance (Ho & Salimans 2022) in one batched call, as the official sampler uses it.

        The batch is two halves: conditional labels first, null labels second; the first half of x is
        used for both (the second half of x is ignored), and the guided prediction
            uncond + cfg_scale * (cond - uncond)
        is returned for both halves. Only the first `guidance_channels` channels are guided: the official
        FID figures (2.27 for DiT-XL/2 at scale 1.5) used 3 of the 4 latent channels; None guides all the
        predicted channels (the noise or velocity; a learned variance is never guided). `interval`, a pair
        (t_lo, t_hi) on the 0..1000 scale, guides only inside that noise range and samples conditionally
        elsewhere (Kynkaanniemi et al. 2024, "Applying guidance in a limited interval").
        """
        half = x[: x.shape[0] // 2]
        out = self(jnp.concatenate([half, half]), t, y)              # (2B, H, W, C_out)
        n = self.cfg.in_channels if guidance_channels is None else guidance_channels
        guided, rest = out[..., :n], out[..., n:]
        cond, uncond = jnp.split(guided, 2)
        scale = jnp.full(t.shape, cfg_scale, jnp.float32)
        if interval is not None:
            scale = jnp.where((t >= interval[0]) & (t <= interval[1]), scale, 1.0)
        scale = scale[: half.shape[0], None, None, None]
        mixed = uncond + scale * (cond - uncond)
        return jnp.concatenate([jnp.concatenate([mixed, mixed]), rest], axis=-1)


def count_params(model):
    """Number of learnable parameters. (The official count also includes the fixed position table,
    which PyTorch stores as a frozen parameter: add T * D to compare.)"""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


#################################################################################
#                     Official PyTorch checkpoints, without torch               #
#################################################################################

def torch_name(path):
    """The PyTorch state-dict key of one of our parameters: ('blocks', 0, 'attn', 'qkv', 'kernel') ->
    'blocks.0.attn.qkv.weight'. nnx.Sequential stores its layers under 'layers', which PyTorch omits."""
    names = [str(p) for p in path if p != "layers"]
    names[-1] = {"kernel": "weight", "embedding": "weight", "scale": "weight"}.get(names[-1], names[-1])
    return ".".join(names)


def to_torch_layout(leaf, value):
    """Our layout -> PyTorch's for the parameter called `leaf`: linear kernels (in, out) -> (out, in),
    convolution kernels HWIO -> OIHW; embedding tables, biases and norm scales are the same in both."""
    if leaf != "kernel":
        return value
    return value.T if value.ndim == 2 else value.transpose(3, 2, 0, 1)


def from_torch_layout(leaf, value):
    """PyTorch's layout -> ours, the inverse of to_torch_layout."""
    if leaf != "kernel":
        return value
    return value.T if value.ndim == 2 else value.transpose(2, 3, 1, 0)


def load_state_dict(model, state_dict, what):
    """Copy a PyTorch state dict into `model`, checking every key and shape; conversions in to_torch_layout.

    Keys the model lacks, and model parameters the file lacks, are errors that name them: they mean
    the file holds another architecture. `what` names the file in messages.
    """
    params = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(params)
    ours = {torch_name(path): (path, var) for path, var in flat}
    missing = sorted(set(ours) - set(state_dict))
    if missing:
        raise ValueError(f"{what} lacks {len(missing)} parameters of the model, e.g. {missing[:5]}: "
                         f"it holds another architecture or configuration")
    for name, (path, var) in ours.items():
        value = from_torch_layout(path[-1], np.asarray(state_dict[name]))
        if value.shape != var.shape:
            raise ValueError(f"{what}: {name} has shape {state_dict[name].shape} but the model expects "
                             f"{to_torch_layout(path[-1], np.empty(var.shape)).shape}: the checkpoint is from "
                             f"another model size or configuration")
        var[...] = jnp.asarray(value, var.dtype)
    return set(state_dict) - set(ours)


def infer_dit_config(state_dict):
    """Recover a DiTConfig from the shapes in an official state dict (heads from the official sizes)."""
    D, C, p, _ = state_dict["x_embedder.proj.weight"].shape
    T = state_dict["pos_embed"].shape[1]
    depth = len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")})
    heads = {v["hidden_size"]: v["num_heads"] for v in DIT_SIZES.values()}.get(D)
    if heads is None:
        raise ValueError(f"hidden size {D} is not one of the official sizes, so the number of heads is "
                         f"unknown: pass a DiTConfig")
    out = state_dict["final_layer.linear.weight"].shape[0] // (p * p)
    table = state_dict.get("y_embedder.embedding_table.weight")
    side = int(round(math.sqrt(T))) * p
    return DiTConfig(input_size=side, patch_size=p, in_channels=C, hidden_size=D, depth=depth, num_heads=heads,
                     num_classes=0 if table is None else table.shape[0] - 1, learn_sigma=out == 2 * C)


def load_dit_checkpoint(path, cfg: DiTConfig | None = None, **model_kwargs):
    """A DiT with the weights of an official PyTorch checkpoint (a released `DiT-XL-2-256x256.pt`, or a
    checkpoint of the official train.py, whose EMA weights are taken). torch is not needed: the file is
    read by fid.load_torch, a restricted unpickler that refuses anything but tensors.

    The configuration is read from the weights' shapes unless `cfg` is given; keyword arguments go to DiT.
    """
    state_dict = load_torch(path)
    if isinstance(state_dict, dict) and "ema" in state_dict:
        state_dict = state_dict["ema"]
    if not isinstance(state_dict, dict) or "x_embedder.proj.weight" not in state_dict:
        raise ValueError(f"{path} is not a DiT state dict (no 'x_embedder.proj.weight')")
    cfg = cfg or infer_dit_config(state_dict)
    model = DiT(cfg, rngs=nnx.Rngs(0), **model_kwargs)
    extra = load_state_dict(model, state_dict, path) - {"pos_embed"}
    if extra:
        raise ValueError(f"{path} has parameters the model lacks, e.g. {sorted(extra)[:5]}: it holds "
                         f"another architecture or configuration")
    table = sincos_pos_embed_2d(cfg.hidden_size, *cfg.grid)
    if not np.allclose(np.asarray(state_dict["pos_embed"])[0], table, atol=1e-5):
        raise ValueError(f"{path}: pos_embed differs from the 2-D sin-cos table of a {cfg.grid} grid")
    return model
