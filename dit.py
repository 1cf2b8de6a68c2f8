"""Diffusion Transformers (DiT) in JAX: the model, its objectives and samplers, and everything to
train, sample and evaluate it.

Paper: "Scalable Diffusion Models with Transformers", W. Peebles and S. Xie, ICCV 2023
(arXiv:2212.09748). Official PyTorch code: github.com/facebookresearch/DiT. On the same weights and
inputs this file gives the official numbers (see test_dit.py and the fixtures it reads).

The file is a book in four parts. Part I is DiT itself, pure functions and modules with no file
input or output that use no name defined after them: a reader can stop at its end. Part II holds
the ideas beyond the paper that the harness trains, each a section to study as Part I's, read the
same way. Part III is the harness, the machinery that runs them. Part IV, an appendix, reads the
files from outside, checking every claim they make; the harness calls into it, the one part that a
reader meets before its definitions. Banners show the level: a part in a tall box, a numbered
section in a box of three lines, a sub-section in one line of dashes.

    Part I: the core
      1. Configuration                    the model sizes of the paper; InputError
      2. Embeddings                       timesteps, class labels, patch positions
      3. The DiT model                    embed, adaLN-Zero blocks, the linear decoder, guidance
      4. DDPM                             the paper's objective and samplers, as the official code
      5. Rectified flow                   straight paths from data to noise, Euler and Heun
      6. The training step                loss, gradients, AdamW, EMA: one jit-able step
      7. Sampling                         noise and labels in, samples out
    Part II: beyond the paper
      8. Memory and speed                 recomputation, fused attention, float32 matrix products
      9. DiT+                             QK-norm, RMSNorm, SwiGLU, RoPE: the paper's block extended
     10. EDM                              a third objective; OBJECTIVES, the one list of them
     11. Deferred masking                 MicroDiT's cheaper step: mix every patch, train on a share
     12. Auxiliary losses                 dispersive loss, SRA, internal guidance: blocks opened
    Part III: the harness
     13. Weight files                     PyTorch state dicts (DiT, VAE), safetensors
     14. The autoencoder                  the Stable Diffusion VAE that maps images to latents
     15. Data                             MNIST, CIFAR-10, image folders, ImageNet-100, the loader
     16. Checkpoints                      atomic saves, exact resume on any number of devices
     17. The training loop                the mesh, the run directory, train()
     18. Sampling and evaluation          grids, one path from a model to scored samples
     19. Benchmark                        images/s, MFU, memory; compiled for a device not here
     20. Reports                          runs side by side: curves.png and report.md
     21. Configuration and command line   one dataclass per command, its parser; one-line errors
    Part IV: appendix, files from outside
     22. Pickles and PyTorch files        a restricted unpickler; torch files without torch
     23. Arrays                           .npz, safetensors, IDX, CIFAR-10's pickles
     24. JSON and downloads               checked JSON, verified downloads

Run `python dit.py --help`. In a notebook, paste this file's text into a cell (or import it) and
call main(["--size", "S", ...]) with the same arguments, or train(TrainConfig(size="S", ...)).
"""

import argparse
import collections
import contextlib
import contextvars
import dataclasses
import functools
import gzip
import hashlib
import http.client
import io
import itertools
import json
import math
import os
import pickle
import pickletools
import re
import reprlib
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import types
import urllib.request
import warnings
import zipfile
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding, PartitionSpec as P
from PIL import Image
with warnings.catch_warnings():  # without ipywidgets, tqdm.auto says so and draws text bars
    warnings.simplefilter("ignore")
    from tqdm.auto import tqdm

# Run as a script or pasted into a notebook cell, this code registers itself as `dit`, so that
# fid.py's `import dit` finds it rather than loading a second copy (with a second InputError).
if __name__ == "__main__":
    sys.modules.setdefault("dit", sys.modules["__main__"])

#################################################################################
#                                                                               #
#                               PART I: THE CORE                                #
#                                                                               #
#################################################################################

#################################################################################
#                                1. Configuration                               #
#################################################################################

# Hidden size, depth and heads of Table 1's four model sizes: with patch size 2, 4 or 8, the twelve
# official DiT-S/2 ... DiT-XL/8. XS and XXS, not the paper's, train in minutes on a CPU.
DIT_SIZES = {"S": dict(hidden_size=384, depth=12, num_heads=6),
             "B": dict(hidden_size=768, depth=12, num_heads=12),
             "L": dict(hidden_size=1024, depth=24, num_heads=16),
             "XL": dict(hidden_size=1152, depth=28, num_heads=16),
             "XS": dict(hidden_size=256, depth=6, num_heads=4),
             "XXS": dict(hidden_size=128, depth=6, num_heads=4)}  # the MNIST demo's

class InputError(ValueError):
    """What the user gave (a file, folder, option, data) cannot be used; the message says what to
    do."""

@dataclasses.dataclass(frozen=True)
class DiTConfig:
    """Architecture of a DiT. The defaults are DiT-XL/2 on 256x256 images (32x32x4 latents)."""
    input_size: int = 32             # height and width of the (square) latent or pixel input
    patch_size: int = 2
    in_channels: int = 4
    hidden_size: int = 1152
    depth: int = 28
    num_heads: int = 16
    mlp_ratio: float = 4.0
    class_dropout_prob: float = 0.1  # > 0 adds the null label that classifier-free guidance needs
    num_classes: int = 1000          # 0 trains an unconditional model
    learn_sigma: bool = True         # DDPM with learned variance doubles the output channels
    # DiT+: changes that later work found to help at DiT's scale, each on its own switch, which
    # DiTPlus reads (Part II); all off is the paper's DiT (ARCHS, below, names the sets).
    qk_norm: bool = False            # RMSNorm on each head's queries and keys
    rms_norm: bool = False           # RMSNorm instead of LayerNorm before every modulate
    swiglu: bool = False             # a SwiGLU feed-forward layer with as many weights
    rope: bool = False               # 2-D rotary position embeddings, beside the sin-cos table
    # Heads on the tokens of an intermediate block (Part II, section 12), trained by their terms:
    internal_block: int = 0          # > 0: internal guidance's output head after this block
    sra_head: bool = False           # SRA's projection head, for training only: never exported

    def __post_init__(self):
        if self.input_size % self.patch_size:
            raise InputError(f"the patch size {self.patch_size} does not divide the input size "
                             f"{self.input_size}; choose a patch size that does")

    @property
    def grid(self):
        """Number of patches along each side: the model sees grid * grid tokens."""
        return self.input_size // self.patch_size

    @property
    def out_channels(self):
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

# The named architectures: the paper's DiT, and DiT+ with the changes that the README's ablation
# kept. QK-norm did not help there and stays a switch: a stabiliser for large models in bfloat16.
ARCHS = {"dit": dict(qk_norm=False, rms_norm=False, swiglu=False, rope=False),
         "dit+": dict(qk_norm=False, rms_norm=True, swiglu=True, rope=True)}

#################################################################################
#           2. Embeddings: timesteps, class labels and patch positions          #
#################################################################################

# The official code initialises every linear layer Xavier-uniform with zero bias, then overrides
# the embeddings with normal(0.02) and the adaLN and output layers with zeros ("adaLN-Zero").
xavier = nnx.initializers.xavier_uniform()
normal02 = nnx.initializers.normal(0.02)
zeros = nnx.initializers.zeros_init()

def timestep_embedding(t, dim, max_period=10000):
    """Sinusoidal features (B, dim) of timesteps t (B,), cosines first, as the official code."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)

def sincos_pos_embed_2d(dim, grid):
    """The fixed 2-D sin-cos position table (grid**2, dim), as MAE's; float64 numpy, a constant when
    compiled."""
    def embed_1d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)  # (T, d/2)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    rows, cols = np.indices((grid, grid), dtype=np.float64)
    return np.concatenate([embed_1d(dim // 2, cols), embed_1d(dim // 2, rows)], axis=1)

class TimestepEmbedder(nnx.Module):
    """Timesteps to vectors: sinusoidal features, then a two-layer MLP with SiLU (ADM's, Sec. 4)."""

    def __init__(self, hidden_size, freq_size=256, *, dtype, rngs):
        self.freq_size = freq_size
        self.mlp = nnx.Sequential(
            nnx.Linear(freq_size, hidden_size, kernel_init=normal02, dtype=dtype, rngs=rngs),
            nnx.silu,
            nnx.Linear(hidden_size, hidden_size, kernel_init=normal02, dtype=dtype, rngs=rngs))

    def __call__(self, t):  # (B,) -> (B, D)
        return self.mlp(timestep_embedding(t, self.freq_size))

class LabelEmbedder(nnx.Module):
    """Embeds class labels; with dropout_prob > 0, training drops some to the null label
    `num_classes`, for guidance."""

    def __init__(self, num_classes, hidden_size, dropout_prob, *, rngs):
        self.num_classes, self.dropout_prob = num_classes, dropout_prob
        self.embedding_table = nnx.Embed(num_classes + (dropout_prob > 0), hidden_size,
                                         embedding_init=normal02, rngs=rngs)

    def __call__(self, labels, drop_key=None):  # (B,) -> (B, D)
        return self.embedding_table(self.drop(labels, drop_key))

    def drop(self, labels, drop_key=None):  # with drop_key, some labels dropped as in training
        if drop_key is None or self.dropout_prob == 0:
            return labels
        drop = jax.random.uniform(drop_key, labels.shape) < self.dropout_prob
        return jnp.where(drop, self.num_classes, labels)

#################################################################################
#                                3. The DiT model                               #
#################################################################################
# The paper's model, as Fig. 3 draws it; the switches of DiT+ (Part II) replace some of its parts.

def modulate(x, shift, scale):
    """adaLN: scale and shift the normalised tokens x (B, T, D) per sample with (B, D) vectors."""
    return x * (1 + scale[:, None]) + shift[:, None]

def layer_norm(x, eps=1e-6):
    """LayerNorm without affine parameters, in float32: bfloat16 variances lose too much
    precision."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)

def adaln_zero(dim, n, *, dtype, rngs):
    """adaLN-Zero: SiLU, then a zero-initialised map from c (B, D) to n shifts, scales and gates
    (B, n*D)."""
    return nnx.Sequential(nnx.silu, nnx.Linear(dim, n * dim, kernel_init=zeros, dtype=dtype,
                                               rngs=rngs))

class PatchEmbed(nnx.Module):
    """Patchify (Sec. 3.2): each p x p patch becomes a token, by a stride-p convolution."""

    def __init__(self, in_channels, hidden_size, patch_size, *, dtype, rngs):
        # Xavier over the flattened patch, as the official code initialises the weight's 2-D view.
        init = nnx.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=(0, 1, 2),
                                                 out_axis=-1)
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

    def __call__(self, x, positions=None):  # (B, T, D) -> (B, T, D)
        B, T, D = x.shape
        H, dtype = self.num_heads, self.qkv.dtype or x.dtype
        x = x.astype(dtype)
        # q, k and v each from its third of the fused weight: three products that cuDNN's attention
        # reads as they are, where one (B, T, 3D) product is split by copying all three.
        kernel, bias = (jnp.split(w[...].astype(dtype), 3, axis=-1)
                        for w in (self.qkv.kernel, self.qkv.bias))
        q, k, v = ((x @ w + b).reshape(B, T, H, D // H)  # each (B, T, H, D/H)
                   for w, b in zip(kernel, bias))
        return self.proj(self.attend(q, k, v, positions).reshape(B, T, D))

    def attend(self, q, k, v, positions):  # softmax(q k^T / sqrt(D/H)) v, each (B, T, H, D/H)
        return jax.nn.dot_product_attention(q, k, v)  # positions: in the tokens (DiT+: RoPE's)

def gelu(x):
    """The tanh-approximated GELU of the official Mlp."""
    return jax.nn.gelu(x, approximate=True)

class Mlp(nnx.Module):
    """The transformer's feed-forward layer: Linear, GELU, Linear."""

    def __init__(self, dim, hidden, act=gelu, *, dtype, rngs):
        self.fc1 = nnx.Linear(dim, hidden, kernel_init=xavier, dtype=dtype, rngs=rngs)
        self.act = act
        self.fc2 = nnx.Linear(hidden, dim, kernel_init=xavier, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # (B, T, D) -> (B, T, D)
        return self.fc2(self.act(self.fc1(x)))

class DiTBlock(nnx.Module):
    """A DiT block with adaLN-Zero (Sec. 3.2; best in Fig. 5): shifts, scales and gates from c, zero
    at first: each block starts as the identity."""

    def __init__(self, cfg: DiTConfig, *, dtype, rngs):
        self.norm = self.normalisation(cfg)
        self.attn = self.attention(cfg, dtype=dtype, rngs=rngs)
        self.mlp = self.feed_forward(cfg, dtype=dtype, rngs=rngs)
        self.adaLN_modulation = adaln_zero(cfg.hidden_size, 6, dtype=dtype, rngs=rngs)

    @staticmethod
    def normalisation(cfg):  # DiT+'s block replaces it, attention and feed_forward
        return layer_norm

    def attention(self, cfg, **layer):
        return Attention(cfg.hidden_size, cfg.num_heads, **layer)

    def feed_forward(self, cfg, **layer):
        return Mlp(cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio), **layer)

    def __call__(self, x, c, positions=None):  # x (B, T, D), c (B, D), positions (B, T) or None
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(
            self.adaLN_modulation(c), 6, axis=-1)
        x = x + gate_msa[:, None] * self.attn(modulate(self.norm(x), shift_msa, scale_msa),
                                              positions)
        return x + gate_mlp[:, None] * self.mlp(modulate(self.norm(x), shift_mlp, scale_mlp))

class FinalLayer(nnx.Module):
    """adaLN-modulated LayerNorm and a zero-initialised linear decoder from tokens to patches."""

    def __init__(self, cfg: DiTConfig, norm=layer_norm, *, dtype, rngs):
        D, p = cfg.hidden_size, cfg.patch_size
        self.norm = norm
        self.linear = nnx.Linear(D, p * p * cfg.out_channels, kernel_init=zeros, dtype=dtype,
                                 rngs=rngs)
        self.adaLN_modulation = adaln_zero(D, 2, dtype=dtype, rngs=rngs)

    def __call__(self, x, c):  # x (B, T, D), c (B, D) -> (B, T, p*p*C_out)
        shift, scale = jnp.split(self.adaLN_modulation(c), 2, axis=-1)
        return self.linear(modulate(self.norm(x), shift, scale))

class DiT(nnx.Module):
    """DiT: x (B, H, W, C), t (B,), y (B,) -> the objective's target (B, H, W, C_out), in `dtype`;
    parameters float32."""
    Block = DiTBlock  # DiTPlus (Part II) builds DiT+'s in its place

    def __init__(self, cfg: DiTConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, **block_options):
        self.cfg, self.dtype = cfg, dtype
        D = cfg.hidden_size
        self.x_embedder = PatchEmbed(cfg.in_channels, D, cfg.patch_size, dtype=dtype, rngs=rngs)
        self.t_embedder = TimestepEmbedder(D, dtype=dtype, rngs=rngs)
        if cfg.num_classes:
            self.y_embedder = LabelEmbedder(cfg.num_classes, D, cfg.class_dropout_prob, rngs=rngs)
        self.blocks = nnx.List([self.Block(cfg, dtype=dtype, rngs=rngs, **block_options)
                                for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(cfg, self.Block.normalisation(cfg), dtype=dtype, rngs=rngs)

    def __call__(self, x, t, y, drop_key=None):
        """t on the 0..1000 scale; `drop_key` turns on training's label dropout."""
        return self.forward(x, t, y, drop_key)[0]

    def forward(self, x, t, y, drop_key=None, taps=(), keep=None, mix=0):
        """(the prediction, {"c": c, "block{k}": the tokens after block k of `taps`}); with `keep`
        (B, T_keep), blocks after `mix` see only those patches, the prediction elsewhere zero."""
        x, c = self.embed(x, t, y, drop_key)                         # (B, T, D), (B, D)
        hidden, positions = {"c": c}, None
        for k, block in enumerate(self.blocks, 1):
            if keep is not None and k == mix + 1:                    # each image keeps its share
                x, positions = jnp.take_along_axis(x, keep[..., None], axis=1), keep
            x = block(x, c, positions)                               # (B, T or T_keep, D)
            if k in taps:
                hidden[f"block{k}"] = x
        return self.unpatchify(self.final_layer(x, c), keep), hidden  # (B, H, W, C_out)

    def embed(self, x, t, y, drop_key=None):
        """Fig. 3's tokens plus positions (B, T, D) and c (B, D) from t and y."""
        x = self.x_embedder(x.astype(self.dtype))                    # (B, T, D)
        x = x + jnp.asarray(sincos_pos_embed_2d(self.cfg.hidden_size, self.cfg.grid), self.dtype)
        c = self.t_embedder(t)                                       # (B, D)
        if self.cfg.num_classes:
            c = c + self.y_embedder(y, drop_key)
        return x, c

    def unpatchify(self, x, keep=None):  # (B, T, p*p*C) -> (B, H, W, C), float32
        """Patches back to the image; with keep, x holds only those (B, T_keep, p*p*C), the rest
        zero."""
        g, p = self.cfg.grid, self.cfg.patch_size
        if keep is not None:
            full = jnp.zeros((x.shape[0], g * g, x.shape[-1]), x.dtype)
            x = full.at[jnp.arange(x.shape[0])[:, None], keep].set(x)
        x = x.reshape(x.shape[0], g, g, p, p, -1).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(x.shape[0], g * p, g * p, -1).astype(jnp.float32)

    def forward_with_cfg(self, x, t, y, cfg_scale, guidance_channels=None, interval=None,
                         guide=None, predict=None):
        """Classifier-free guidance (Ho & Salimans 2022): x's first half with labels and with
        null labels, uncond + cfg_scale * (cond - uncond) on `guidance_channels` (None: all but a
        learned variance) where t is in `interval`; `guide` (prediction, w) adds (w - 1) * (cond
        - guide)."""
        half = x[: x.shape[0] // 2]
        out = (predict or self)(jnp.concatenate([half, half]), t, y)  # (2B, H, W, C_out)
        C = self.cfg.in_channels
        n = C if guidance_channels is None else min(guidance_channels, C)
        cond, uncond = jnp.split(out[..., :n], 2)                    # each (B, H, W, n)
        scale = jnp.full(t.shape, cfg_scale, jnp.float32)
        if interval is not None:
            scale = jnp.where((t >= interval[0]) & (t <= interval[1]), scale, 1.0)
        mixed = uncond + scale[: half.shape[0], None, None, None] * (cond - uncond)
        if guide is not None:
            mixed = mixed + (guide[1] - 1) * (cond - guide[0][..., :n])
        return jnp.concatenate([jnp.concatenate([mixed, mixed]), out[..., n:]], axis=-1)

def count_params(model):
    """Number of learnable parameters, without the fixed position table (T * D) that the official
    count includes."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

#################################################################################
#                                    4. DDPM                                    #
#################################################################################
# Two objectives train and sample the same network. This section is DDPM exactly as the official DiT
# trains and samples it (facebookresearch/DiT, diffusion/gaussian_diffusion.py and respace.py,
# themselves taken from OpenAI's improved-diffusion / guided-diffusion); the next is rectified flow.
#
# Both talk to the network through one interface: model_fn(x, t) -> out, with x (B, H, W, C) and t
# (B,) float32 timesteps on DiT's 0..1000 scale. The caller closes over labels and guidance, e.g.
# model_fn = lambda x, t: model.forward_with_cfg(x, t, y, cfg_scale).
#
# Both offer the rest of the code one interface: `name` (what checkpoints record, with the SETTINGS
# that rebuild it), `learn_sigma` (whether output channels are doubled), the samplers METHODS, a
# default method and step count, sample(model_fn, noise, key, steps, method, return_trajectory) ->
# x0 or (x0, its steps+1 states from noise on), training_losses and losses_at (per-sample losses and
# noise levels in [0, 1], (B,), the levels mapped to the objective's time by `time_at`). `mask`,
# weights broadcastable to the elementwise loss (B, H, W, C), counts only the masked elements.

def space_timesteps(num_timesteps: int, section_counts: str) -> list[int]:
    """The original timesteps a respaced sampler visits, ascending (official respace.py): "ddimN", N
    evenly strided; "N1,N2,...", N_i from each equal section, ends included."""
    if not isinstance(section_counts, str):
        raise TypeError(f"timestep respacing must be a string such as '250' or 'ddim25', got "
                        f"{section_counts!r}")
    if section_counts.startswith("ddim"):
        try:
            desired = int(section_counts[len("ddim"):])
        except ValueError:
            raise ValueError(f"timestep respacing {section_counts!r}: expected 'ddim' followed by "
                             f"a step count, e.g. 'ddim25'") from None
        for stride in range(1, num_timesteps):
            if len(range(0, num_timesteps, stride)) == desired:
                return list(range(0, num_timesteps, stride))
        raise ValueError(f"timestep respacing {section_counts!r}: no integer stride gives exactly "
                         f"{desired} of {num_timesteps} steps; pick another count or use plain "
                         f"'{desired}' spacing")
    try:
        counts = [int(c) for c in section_counts.split(",")]
    except ValueError:
        raise ValueError(f"timestep respacing {section_counts!r}: expected a step count ('250'), "
                         f"counts per section ('10,15,20') or 'ddimN'") from None
    size_per, extra = divmod(num_timesteps, len(counts))
    start, steps = 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)  # the first `extra` sections take one more step
        if not 1 <= count <= size:
            raise ValueError(f"timestep respacing {section_counts!r}: section {i} has {size} "
                             f"steps, cannot take {count} of them (need 1 <= count <= {size})")
        stride = (size - 1) / (count - 1) if count > 1 else 1
        # accumulated and rounded (to even) as the official code does: same string, same steps
        positions = itertools.accumulate([stride] * (count - 1), initial=0.0)
        steps += [start + round(cur) for cur in positions]
        start += size
    return sorted(set(steps))

def _extract(table, t, ndim):
    """table[t] for step indices t (B,), float32, shaped (B, 1, ..., 1) to broadcast over x, as the
    official _extract_into_tensor."""
    values = jnp.asarray(table, dtype=jnp.float32)[t]
    return values.reshape(values.shape + (1,) * (ndim - 1))

def _mean_flat(x, mask=None):
    """Mean over all axes but the batch's, (B,); with a mask, over the masked elements."""
    axes = tuple(range(1, x.ndim))
    if mask is None:
        return jnp.mean(x, axis=axes)
    mask = jnp.broadcast_to(mask, x.shape)
    return jnp.sum(x * mask, axes) / jnp.maximum(jnp.sum(mask, axes), jnp.finfo(jnp.float32).tiny)

def _normal_kl(mean1, logvar1, mean2, logvar2):
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + jnp.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * jnp.exp(-logvar2))

def _discretized_gaussian_log_likelihood(x, means, log_scales):
    """log P(x) per element of data x in [-1, 1] under N(means, e^(2 log_scales)) over bins of width
    2/255 (Ho et al. 2020 eq. 13)."""
    def cdf(v):  # the official tanh approximation of the standard normal CDF, so the VLB matches
        return 0.5 * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3)))
    centered, inv_std = x - means, jnp.exp(-log_scales)
    cdf_plus = cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = cdf(inv_std * (centered - 1.0 / 255.0))
    p = jnp.where(x < -0.999, cdf_plus, jnp.where(x > 0.999, 1.0 - cdf_min, cdf_plus - cdf_min))
    return jnp.log(jnp.maximum(p, 1e-12))

def check_output(objective, out, x):
    """`out`, or a ValueError unless it has the objective's channels: 2C under learned variance,
    else C."""
    C = x.shape[-1]
    if out.shape != x.shape[:-1] + ((2 if objective.learn_sigma else 1) * C,):
        raise ValueError(f"the objective {objective.name} needs the model's output for x of shape "
                         f"{x.shape} to have {2 * C if objective.learn_sigma else C} channels, got "
                         f"{out.shape}; build the DiT with learn_sigma={objective.learn_sigma}")
    return out

class GaussianDiffusion:
    """DDPM with learned variance (Ho et al. 2020; Nichol & Dhariwal 2021), the official
    create_diffusion. `timestep_respacing` ("250", "ddim25"; "": all) keeps some steps' alpha-bar; t
    indexes that chain, the network sees timestep_map[t]."""

    name, learn_sigma, SETTINGS = "ddpm", True, ()
    METHODS = ("ddpm", "ddim")  # its samplers; the paper's: ancestral sampling over 250 steps
    default_method, default_steps = "ddpm", 250

    def __init__(self, timestep_respacing: str = "", num_timesteps: int = 1000):
        if not (isinstance(num_timesteps, int) and num_timesteps > 1):
            raise ValueError(f"num_timesteps must be an int > 1, got {num_timesteps!r}")
        # Ho et al.'s linear schedule, scaled so that any T has about the total noise of T = 1000
        scale = 1000 / num_timesteps
        base_betas = np.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=np.float64)
        base_alphas_cumprod = np.cumprod(1.0 - base_betas)

        self.base_timesteps = num_timesteps
        self.timestep_map = np.array(space_timesteps(num_timesteps,
                                                     timestep_respacing or str(num_timesteps)))
        if len(self.timestep_map) < 2:  # the clipping below needs a step t = 1
            raise ValueError(f"a DDPM chain needs at least 2 steps, {timestep_respacing!r} gives "
                             f"{len(self.timestep_map)}")
        kept = base_alphas_cumprod[self.timestep_map]
        # The official code respaces even when keeping every step, which changes betas in the last
        # bits; do the same so that the constants match theirs exactly.
        self.betas = 1.0 - kept / np.append(1.0, kept[:-1])
        self.num_timesteps = len(self.betas)

        alphas = 1.0 - self.betas
        self.alphas_cumprod = abar = np.cumprod(alphas)
        self.alphas_cumprod_prev = abar_prev = np.append(1.0, abar[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(abar)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - abar)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / abar)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / abar - 1.0)
        # q(x_{t-1} | x_t, x_0) = N(coef1 x_0 + coef2 x_t, posterior_variance), Ho et al. eq. 6-7
        posterior_variance = self.betas * (1.0 - abar_prev) / (1.0 - abar)
        # the variance is 0 at t = 0; its log is clipped to the next value so that it stays finite
        self.posterior_log_variance_clipped = np.log(np.append(posterior_variance[1],
                                                               posterior_variance[1:]))
        self.posterior_mean_coef1 = self.betas * np.sqrt(abar_prev) / (1.0 - abar)
        self.posterior_mean_coef2 = (1.0 - abar_prev) * np.sqrt(alphas) / (1.0 - abar)

    def _model_time(self, t):
        """Step indices -> the original timesteps, float32."""
        return jnp.asarray(self.timestep_map, dtype=jnp.float32)[t]

    def _q_posterior(self, x0, x_t, t):
        """Mean and clipped log-variance of q(x_{t-1} | x_t, x_0)."""
        mean = (_extract(self.posterior_mean_coef1, t, x_t.ndim) * x0
                + _extract(self.posterior_mean_coef2, t, x_t.ndim) * x_t)
        return mean, _extract(self.posterior_log_variance_clipped, t, x_t.ndim)

    def p_mean_variance(self, model_out, x, t_index):
        """p(x_{t-1} | x_t) from model_out: eps, then v in [-1, 1] interpolating the log-variance
        (Nichol & Dhariwal eq. 15). Returns dict(mean, log_variance, pred_xstart), unclipped."""
        eps, var_values = jnp.split(check_output(self, model_out, x), 2, axis=-1)
        min_log = _extract(self.posterior_log_variance_clipped, t_index, x.ndim)
        max_log = _extract(np.log(self.betas), t_index, x.ndim)
        frac = (var_values + 1) / 2
        log_variance = frac * max_log + (1 - frac) * min_log
        # invert x_t = sqrt(abar) x_0 + sqrt(1 - abar) eps for x_0
        pred_xstart = (_extract(self.sqrt_recip_alphas_cumprod, t_index, x.ndim) * x
                       - _extract(self.sqrt_recipm1_alphas_cumprod, t_index, x.ndim) * eps)
        mean, _ = self._q_posterior(pred_xstart, x, t_index)
        return {"mean": mean, "log_variance": log_variance, "pred_xstart": pred_xstart}

    def time_at(self, level):
        """Step indices of noise levels in [0, 1], rounded down."""
        return jnp.minimum((level * self.num_timesteps).astype(jnp.int32), self.num_timesteps - 1)

    def losses_at(self, model_fn, x0, t, noise, mask=None):
        """Per-sample losses at step indices t (official training_losses): dict(loss, mse, vb in
        bits per dimension, level), each (B,)."""
        x_t = (_extract(self.sqrt_alphas_cumprod, t, x0.ndim) * x0
               + _extract(self.sqrt_one_minus_alphas_cumprod, t, x0.ndim) * noise)
        model_out = model_fn(x_t, self._model_time(t))  # (B, H, W, 2C)
        eps = model_out[..., :x0.shape[-1]]
        # The VLB term trains only the variance: the mean it sees is frozen, so the eps head learns
        # from the MSE alone (the official `frozen_out`).
        frozen = model_out.at[..., :x0.shape[-1]].set(jax.lax.stop_gradient(eps))
        p = self.p_mean_variance(frozen, x_t, t)
        true_mean, true_log_variance = self._q_posterior(x0, x_t, t)
        kl = _mean_flat(_normal_kl(
            true_mean, true_log_variance, p["mean"], p["log_variance"]), mask) / np.log(2.0)
        decoder_nll = -_mean_flat(_discretized_gaussian_log_likelihood(
            x0, p["mean"], 0.5 * p["log_variance"]), mask) / np.log(2.0)
        # at t = 0 there is no posterior to match: the term is the likelihood of the data itself
        vb = jnp.where(t == 0, decoder_nll, kl)
        mse = _mean_flat((noise - eps) ** 2, mask)
        return {"loss": mse + vb, "mse": mse, "vb": vb, "level": t / self.num_timesteps}

    def draw(self, key, x0):
        """Training's t (B,) uniform over the chain's steps and standard normal noise like x0."""
        key_t, key_noise = jax.random.split(key)
        t = jax.random.randint(key_t, (x0.shape[0],), 0, self.num_timesteps)
        return t, jax.random.normal(key_noise, x0.shape, x0.dtype)

    def training_losses(self, model_fn, x0, key, mask=None):
        """losses_at with t and noise drawn from key."""
        return self.losses_at(model_fn, x0, *self.draw(key, x0), mask)

    def sample(self, model_fn, noise, key, steps, method="ddpm", return_trajectory=False):
        """walk() the chain respaced to `steps` ("ddim{steps}" for DDIM)."""
        check_sampler(self, steps, method)
        chain = GaussianDiffusion(f"ddim{steps}" if method == "ddim" else str(steps),
                                  self.base_timesteps)
        return chain.walk(model_fn, noise, key, method, return_trajectory)

    def walk(self, model_fn, noise, key=None, method="ddpm", return_trajectory=False):
        """Sample down this chain from noise: "ddpm" ancestrally, "ddim" deterministically (eta = 0;
        Song et al. 2021); x_0 unclipped, as for latents."""
        check_sampler(self, self.num_timesteps, method)
        if method == "ddpm" and key is None:
            raise ValueError("ancestral ('ddpm') sampling draws fresh noise: pass a PRNG key")
        steps = jnp.arange(self.num_timesteps - 1, -1, -1)
        step_keys = jax.random.split(key, self.num_timesteps) if method == "ddpm" else None

        def step(x, inputs):
            i, step_key = inputs
            t = jnp.full((x.shape[0],), i)
            p = self.p_mean_variance(model_fn(x, self._model_time(t)), x, t)
            if method == "ddpm":  # fresh noise at every step but the last
                z = jax.random.normal(step_key, x.shape, x.dtype)
                x = p["mean"] + (i > 0) * jnp.exp(0.5 * p["log_variance"]) * z
            else:
                # eps re-derived from pred_xstart as the official code does (the same rounding)
                eps = ((_extract(self.sqrt_recip_alphas_cumprod, t, x.ndim) * x - p["pred_xstart"])
                       / _extract(self.sqrt_recipm1_alphas_cumprod, t, x.ndim))
                alpha_bar_prev = _extract(self.alphas_cumprod_prev, t, x.ndim)
                x = p["pred_xstart"] * jnp.sqrt(alpha_bar_prev) + jnp.sqrt(1 - alpha_bar_prev) * eps
            return x, (x if return_trajectory else None)

        x, trajectory = jax.lax.scan(step, noise, (steps, step_keys))
        return (x, jnp.concatenate([noise[None], trajectory])) if return_trajectory else x

#################################################################################
#                               5. Rectified flow                               #
#################################################################################

class RectifiedFlow:
    """Rectified flow (Liu et al. 2022): x_t = (1 - t) x_0 + t eps, the network regressing
    eps - x_0 at 1000 t; t logit-normal (as SD3) or uniform."""

    name, learn_sigma, SETTINGS = "rf", False, ("timestep_sampling", "loc", "scale")
    # Its samplers; by default Heun at 25 steps, 50 network calls, second order (test_dit.py's
    # Gaussian case: at equal steps its error is below half of Euler's)
    METHODS = ("euler", "heun")
    default_method, default_steps = "heun", 25

    def __init__(self, timestep_sampling="logit_normal", loc=0.0, scale=1.0):
        if timestep_sampling not in ("logit_normal", "uniform"):
            raise InputError(f"unknown timestep_sampling {timestep_sampling!r}; use 'logit_normal' "
                             f"or 'uniform'")
        if not scale > 0:
            raise InputError(f"the logit-normal scale must be positive, got {scale!r}")
        self.timestep_sampling, self.loc, self.scale = timestep_sampling, float(loc), float(scale)

    def sample_timesteps(self, key, n):
        """n training times in [0, 1), float32 (n,)."""
        if self.timestep_sampling == "logit_normal":
            return jax.nn.sigmoid(self.loc + self.scale * jax.random.normal(key, (n,)))
        return jax.random.uniform(key, (n,))

    def _velocity(self, model_fn, x, t):
        """The network's velocity at x and times t (B,) in [0, 1]."""
        return check_output(self, model_fn(x, 1000.0 * t), x)

    def time_at(self, level):
        """The time t of a noise level: the level itself."""
        return level

    def losses_at(self, model_fn, x0, t, noise, mask=None):
        """Per-sample squared velocity errors at times t (B,): dict(loss, level)."""
        t_b = t.reshape((-1,) + (1,) * (x0.ndim - 1))  # (B, 1, 1, 1)
        x_t = (1 - t_b) * x0 + t_b * noise
        error = (noise - x0 - self._velocity(model_fn, x_t, t)) ** 2
        return {"loss": _mean_flat(error, mask), "level": t}

    def draw(self, key, x0):
        """Training's t (B,) from timestep_sampling and standard normal noise like x0."""
        key_t, key_noise = jax.random.split(key)
        noise = jax.random.normal(key_noise, x0.shape, x0.dtype)
        return self.sample_timesteps(key_t, x0.shape[0]), noise

    def training_losses(self, model_fn, x0, key, mask=None):
        """losses_at with t and noise drawn from key."""
        return self.losses_at(model_fn, x0, *self.draw(key, x0), mask)

    def sample(self, model_fn, noise, key, steps: int, method="euler", return_trajectory=False):
        """Euler or Heun in `steps` equal steps from noise at t = 1 to 0; key unused. Heun corrects
        the last step too: the velocity is finite at t = 0."""
        check_sampler(self, steps, method)
        v = lambda x, t: self._velocity(model_fn, x, jnp.full((x.shape[0],), t))  # noqa: E731
        x, trajectory = integrate(v, noise, jnp.linspace(1.0, 0.0, steps + 1), method,
                                  return_trajectory)
        return (x, jnp.concatenate([noise[None], trajectory])) if return_trajectory else x

def check_sampler(objective, steps, method):
    """A ValueError unless `method` is one of the objective's METHODS and `steps` a positive int."""
    if method not in objective.METHODS:
        raise ValueError(f"unknown {objective.name} sampling method {method!r}; use "
                         f"{' or '.join(map(repr, objective.METHODS))}")
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be a positive int, got {steps!r}")

def integrate(f, x, times, method, return_trajectory=False):
    """Integrate dx/dt = f(x, t) through `times` (K+1,), "euler" or "heun" (Karras et al. 2022,
    alg. 1): (final x, the K states or None)."""
    def step(x, t_pair):
        t, t_next = t_pair
        d = f(x, t)
        x_next = x + (t_next - t) * d
        if method == "heun":
            x_next = x + (t_next - t) * 0.5 * (d + f(x_next, t_next))
        return x_next, (x_next if return_trajectory else None)
    return jax.lax.scan(step, x, (times[:-1], times[1:]))

#################################################################################
#                              6. The training step                             #
#################################################################################

def make_optimizer(lr, warmup=0, grad_clip=0.0, betas=(0.9, 0.999)):
    """AdamW without weight decay, as DiT; optional warm-up and clipping. Returns
    (optimizer, schedule)."""
    schedule = optax.linear_schedule(0.0, lr, warmup) if warmup else optax.constant_schedule(lr)
    adamw = optax.adamw(schedule, b1=betas[0], b2=betas[1], eps=1e-8, weight_decay=0.0)
    tx = optax.chain(optax.clip_by_global_norm(grad_clip), adamw) if grad_clip else adamw
    return tx, schedule

def new_train_state(model, tx):
    """A fresh model's state: step, parameters, their EMA (a copy), optimizer state; nested dicts,
    named by path."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "ema": jax.tree.map(jnp.copy, params), "opt_state": tx.init(params)}

def loss_gradient(loss_fn, state):
    """The gradient of loss_fn (params -> (loss, aux)) at the state's parameters, and aux."""
    return jax.grad(loss_fn, has_aux=True)(state["params"])

def batch_losses(objective, model, x, y, key, drop_key, ema):
    """The objective's per-sample losses of the model on x, y; `ema` serves Part II's terms."""
    return objective.training_losses(lambda xt, t: model(xt, t, y, drop_key=drop_key), x, key)

def make_train_step(graphdef, objective, tx, ema_decay, seed, ema_warmup=False,
                    gradient=loss_gradient, batch_losses=batch_losses):
    """One pure step for jit, (state, x, y) -> (state, metrics); step s draws from
    fold_in(key(seed), s), so a resumed run draws the same."""
    def train_step(state, x, y):  # x (B, H, W, C), y (B,)
        key = jax.random.fold_in(jax.random.key(seed), state["step"])
        key_objective, key_drop = jax.random.split(key)

        def loss_fn(params, **part):  # `part`: a micro-batch, for the harness's accumulation
            losses = batch_losses(objective, nnx.merge(graphdef, params), x, y, key_objective,
                                  key_drop, state["ema"], **part)
            return sum(losses.get("aux", {}).values(), losses["loss"].mean()), losses

        grads, losses = gradient(loss_fn, state)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # DiT keeps an exponential moving average of the weights and samples from it. A short run
        # warms it up: the decay grows as (1 + step) / (10 + step) up to ema_decay (the rule of
        # TensorFlow's ExponentialMovingAverage), so that early samples come from trained weights.
        decay = (jnp.minimum(ema_decay, (1.0 + state["step"]) / (10.0 + state["step"]))
                 if ema_warmup else ema_decay)
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, state["ema"], params)
        new_state = {**state, "step": state["step"] + 1, "params": params, "ema": ema,
                     "opt_state": opt_state}
        return new_state, {"loss": losses["loss"].mean(), "grad_norm": optax.tree.norm(grads),
                           "losses": losses}

    return train_step

#################################################################################
#                                  7. Sampling                                  #
#################################################################################

def guides(cfg_scale):
    """Whether CFG at this scale guides: any traced scale does."""
    return isinstance(cfg_scale, jax.core.Tracer) or cfg_scale != 1

def check_guidance(cfg, cfg_scale, internal_scale=1.0):
    """InputError for CFG without a null label or internal guidance without an internal head."""
    if guides(cfg_scale) and cfg.num_classes and not cfg.class_dropout_prob:
        raise InputError("classifier-free guidance: the model was trained without label dropout, "
                         "so it has no null label to guide with; sample at scale 1")
    if internal_scale != 1 and not cfg.internal_block:
        raise InputError(f"internal guidance {internal_scale:g}: the model has no internal head; "
                         f"train it with --internal-guidance, or sample at scale 1")

def sample(model, objective, noise, y, key, *, steps, method, cfg_scale=1.0, guidance_channels=None,
           interval=None, guide=None, guide_scale=1.0, internal_scale=1.0,
           return_trajectory=False):
    """Samples (B, H, W, C) from noise and labels (B,), guided by CFG, by `guide` (autoguidance,
    Karras et al. 2024: guide + w (model - guide)) and internally (internal + w (final - internal)).
    Jit it."""
    check_guidance(model.cfg, cfg_scale, internal_scale)
    n = noise.shape[0]
    c = min(guidance_channels or model.cfg.in_channels, model.cfg.in_channels)
    autoguided = guide is not None and guide_scale != 1
    predict = model
    if internal_scale != 1:
        def predict(x, t, y):
            out, hidden = model.forward(x, t, y)                     # (B, H, W, C_out)
            inner = hidden["internal"][..., :c]
            return out.at[..., :c].set(inner + internal_scale * (out[..., :c] - inner))
    if guides(cfg_scale) and model.cfg.num_classes:
        x = jnp.concatenate([noise, noise])
        y2 = jnp.concatenate([y, jnp.full_like(y, model.cfg.num_classes)])
        model_fn = lambda x, t: model.forward_with_cfg(  # noqa: E731
            x, t, y2, cfg_scale, guidance_channels, interval,
            (guide(x[:n], t[:n], y), guide_scale) if autoguided else None, predict)
    elif autoguided:
        x = noise

        def model_fn(x, t):
            out, worse = predict(x, t, y), guide(x, t, y)            # (B, H, W, C_out) each
            return out.at[..., :c].add((guide_scale - 1) * (out[..., :c] - worse[..., :c]))
    else:
        x, model_fn = noise, lambda x, t: predict(x, t, y)  # noqa: E731
    out = objective.sample(model_fn, x, key, steps, method, return_trajectory=return_trajectory)
    return (out[0][:n], out[1][:, :n]) if return_trajectory else out[:n]

#################################################################################
#                                                                               #
#                           PART II: BEYOND THE PAPER                           #
#                                                                               #
#################################################################################

#################################################################################
#                              8. Memory and speed                              #
#################################################################################
# Nothing here changes what the model computes (test_dit.py checks each). The backward pass needs
# the forward pass's activations: kept, layer_norm's float32 intermediates would take twice the
# tokens' memory in every block, gelu's five more (B, T, 4D) tensors, DiT+'s normalisation and
# rotation of queries and keys four more (B, T, D). DiTPlus recomputes each from its input instead.

# f, recomputed in the backward pass; cached, so that two models built alike have equal graphdefs
recomputed = functools.cache(jax.checkpoint)

# DiTPlus's `remat`, what each block recomputes in the backward pass: "dots" keeps the products with
# weights (qkv, proj, the MLP's, adaLN's) and recomputes the rest (norms, modulations, activations,
# attention), for little extra compute and half the memory (10 numbers per token and hidden unit,
# not 20); "full" keeps each block's input only: a third more compute, for models too big otherwise.
REMAT_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable, "full": None}

def recompute_call(method, module, *args, remat):
    """method(module, *args), recomputed as REMAT_POLICIES[remat] says (None: kept), purely:
    nnx.remat fails under lax.scan."""
    if remat is None:
        return method(module, *args)
    graphdef, state = nnx.split(module)
    pure = lambda state, *args: method(nnx.merge(graphdef, state), *args)  # noqa: E731
    return jax.checkpoint(pure, policy=REMAT_POLICIES[remat])(state, *args)

# On NVIDIA GPUs, cuBLAS for every matrix product rather than XLA's Triton kernels, which ran
# DiT-S/2's forward pass 13% and its training step 3% slower on an H200 (README, Speed). XLA reads
# XLA_FLAGS once, as JAX starts its backend: a notebook that used JAX before this code ran keeps its
# setting, as does a user who sets the flag.
if "--xla_gpu_enable_triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = ("--xla_gpu_enable_triton_gemm=false "
                               + os.environ.get("XLA_FLAGS", ""))

# The devices that programs are traced and compiled for (run_devices): the machine's, or where
# `bench --target` compiles for a device that the machine lacks, that device's (section 19), so
# that a trace picks the attention and precision that the device runs.
TARGET_DEVICES = contextvars.ContextVar("TARGET_DEVICES", default=None)

def run_devices():
    return TARGET_DEVICES.get() or jax.devices()

def compute_capability(device):
    """An NVIDIA GPU's compute capability (8.0: Ampere); 0 elsewhere."""
    return float(getattr(device, "compute_capability", 0) or 0)

def attention_implementation(dtype, head_dim, device=None):
    """"cudnn" (flash attention) on NVIDIA Ampere and later in 16-bit floats, head sizes 8 to 128 by
    8; else "xla"."""
    device = device or run_devices()[0]
    fused = (device.platform == "gpu" and compute_capability(device) >= 8.0
             and dtype in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128)
    return "cudnn" if fused else "xla"

def matmul_precision(dtype):
    """A context where float32 products are float32, not TF32 or bfloat16, unless a precision is
    set."""
    if dtype == jnp.float32 and jax.config.jax_default_matmul_precision is None:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()

#################################################################################
#                     9. DiT+: the switches beyond the paper                    #
#################################################################################

def rms_norm(x, eps=1e-6):
    """RMSNorm (Zhang & Sennrich 2019), as layer_norm: float32, no affine parameters."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)

def rope_tables(head_dim, grid):
    """cos and sin (T, head_dim) of 2-D RoPE: half of the channel pairs turn by the patch's row,
    half by its column."""
    freqs = 1.0 / 10000 ** (np.arange(head_dim // 4) / (head_dim // 4))  # (head_dim/4,)
    rows, cols = np.indices((grid, grid))
    angles = np.concatenate([np.outer(rows.ravel(), freqs), np.outer(cols.ravel(), freqs)], axis=1)
    angles = np.concatenate([angles, angles], axis=1)                     # (T, head_dim)
    return np.cos(angles), np.sin(angles)

def apply_rope(x, cos, sin):
    """Rotate pairs (i, i + d/2) of q or k (B, T, H, d) by angles (T, d) or (B, T, d)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos[..., None, :].astype(x.dtype) + rotated * sin[..., None, :].astype(x.dtype)

class DiTPlusAttention(Attention):
    """Attention with per-head RMSNorm of queries and keys (qk_norm) and RoPE
    (rope_grid, or None)."""

    def __init__(self, dim, num_heads, qk_norm, rope_grid, *, dtype, rngs):
        super().__init__(dim, num_heads, dtype=dtype, rngs=rngs)
        self.qk_norm, self.rope_grid = qk_norm, rope_grid
        if qk_norm:
            self.q_norm = nnx.RMSNorm(dim // num_heads, epsilon=1e-6, dtype=dtype, rngs=rngs)
            self.k_norm = nnx.RMSNorm(dim // num_heads, epsilon=1e-6, dtype=dtype, rngs=rngs)

    def attend(self, q, k, v, positions):
        if self.qk_norm or self.rope_grid is not None:  # recomputed in the backward pass
            q, k = recompute_call(DiTPlusAttention.queries_and_keys, self, q, k, positions,
                                  remat="full")
        return jax.nn.dot_product_attention(
            q, k, v, implementation=attention_implementation(q.dtype, q.shape[-1]))

    def queries_and_keys(self, q, k, positions):  # q, k (B, T, H, D/H); positions (B, T) or None
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_grid is not None:
            rope = tuple(jnp.asarray(a) for a in rope_tables(q.shape[-1], self.rope_grid))
            if positions is not None:  # each token turns by its own patch's position
                rope = tuple(a[positions] for a in rope)                  # each (B, T, D/H)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k

def swish_gate(a, b):
    return jax.nn.silu(a) * b

class SwiGLU(nnx.Module):
    """SwiGLU, w3(silu(x w1) * (x w2)), w1 and w2 fused: at 2/3 of the MLP's width, as many
    weights."""

    def __init__(self, dim, hidden, *, dtype, rngs):
        self.w12 = nnx.Linear(dim, 2 * hidden, kernel_init=xavier, dtype=dtype, rngs=rngs)
        self.w3 = nnx.Linear(hidden, dim, kernel_init=xavier, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # (B, T, D) -> (B, T, D)
        a, b = jnp.split(self.w12(x), 2, axis=-1)
        return self.w3(recomputed(swish_gate)(a, b))

class DiTPlusBlock(DiTBlock):
    """DiT's block with the parts cfg's switches replace, recomputed as `remat` says."""

    def __init__(self, cfg: DiTConfig, *, dtype, remat, rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.remat = remat

    @staticmethod
    def normalisation(cfg):
        return recomputed(rms_norm if cfg.rms_norm else layer_norm)

    def attention(self, cfg, **layer):
        return DiTPlusAttention(cfg.hidden_size, cfg.num_heads, cfg.qk_norm,
                                cfg.grid if cfg.rope else None, **layer)

    def feed_forward(self, cfg, **layer):
        if cfg.swiglu:
            return SwiGLU(cfg.hidden_size, 2 * int(cfg.hidden_size * cfg.mlp_ratio) // 3, **layer)
        return Mlp(cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio), recomputed(gelu), **layer)

    def __call__(self, x, c, positions=None):
        return recompute_call(DiTBlock.__call__, self, x, c, positions, remat=self.remat)

class DiTPlus(DiT):
    """The harness's model: DiT with DiT+'s blocks (every switch off: the paper's), recomputed as
    `remat` says, in matmul_precision."""
    Block = DiTPlusBlock

    def __init__(self, cfg: DiTConfig, *, dtype=jnp.float32, remat=None, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs, remat=remat)
        if cfg.internal_block:  # internal guidance's head, as the final layer (section 12)
            self.internal_head = FinalLayer(cfg, self.Block.normalisation(cfg), dtype=dtype,
                                            rngs=rngs)
        if cfg.sra_head:  # SRA's projection head, trained and never exported (section 12)
            self.sra_head = ProjectionHead(cfg.hidden_size, dtype=dtype, rngs=rngs)

    def forward(self, x, t, y, drop_key=None, taps=(), keep=None, mix=0):
        """DiT's; "internal": the internal head's prediction, with cfg.internal_block."""
        b = self.cfg.internal_block
        with matmul_precision(self.dtype):
            out, hidden = super().forward(x, t, y, drop_key, {*taps, b} if b else taps, keep, mix)
            if b:
                hidden["internal"] = self.unpatchify(
                    self.internal_head(hidden[f"block{b}"], hidden["c"]), keep if b > mix else None)
        return out, hidden

#################################################################################
#                    10. EDM: the objective beyond the paper                    #
#################################################################################

class EDM:
    """EDM (Karras et al. 2022): x = x_0 + sigma n, D(x; sigma) = c_skip x + c_out
    F(c_in x, c_noise), preconditioned for std sigma_data, c_noise = ln(sigma) / 4 mapped onto DiT's
    0..1000. Training: ln(sigma) ~ N(P_MEAN, P_STD^2), weight 1 / c_out^2."""
    name, learn_sigma, SETTINGS = "edm", False, ("sigma_data",)
    # its samplers; by default Heun at their 18 steps (35 network calls)
    METHODS = ("heun", "euler")
    default_method, default_steps = "heun", 18
    P_MEAN, P_STD, SIGMA_MIN, SIGMA_MAX, RHO = -1.2, 1.2, 0.002, 80.0, 7.0

    def __init__(self, sigma_data=0.5):
        if not sigma_data > 0:
            raise InputError(f"EDM's sigma_data must be positive, got {sigma_data!r}")
        self.sigma_data = float(sigma_data)

    def denoise(self, model_fn, x, sigma):
        """D(x; sigma) at noise levels sigma (B,) > 0."""
        s, sd = sigma.reshape((-1,) + (1,) * (x.ndim - 1)), self.sigma_data
        lo, hi = np.log(self.SIGMA_MIN) / 4, np.log(self.SIGMA_MAX) / 4
        out = check_output(self, model_fn(x / jnp.sqrt(s ** 2 + sd ** 2),
                                          1000 * (jnp.log(sigma) / 4 - lo) / (hi - lo)), x)
        return sd ** 2 / (s ** 2 + sd ** 2) * x + s * sd / jnp.sqrt(s ** 2 + sd ** 2) * out

    def time_at(self, level):  # the sigma of a noise level
        return level / (1 - level)

    def losses_at(self, model_fn, x0, sigma, noise, mask=None):
        """Per-sample weighted denoising errors at sigma (B,): dict(loss, level)."""
        s, sd = sigma.reshape((-1,) + (1,) * (x0.ndim - 1)), self.sigma_data
        error = (self.denoise(model_fn, x0 + s * noise, sigma) - x0) ** 2
        return {"loss": _mean_flat((s ** 2 + sd ** 2) / (s * sd) ** 2 * error, mask),
                "level": sigma / (1 + sigma)}

    def draw(self, key, x0):
        """Training's log-normal sigma (B,) and standard normal noise like x0."""
        key_sigma, key_noise = jax.random.split(key)
        sigma = jnp.exp(self.P_MEAN + self.P_STD * jax.random.normal(key_sigma, (x0.shape[0],)))
        return sigma, jax.random.normal(key_noise, x0.shape, x0.dtype)

    def training_losses(self, model_fn, x0, key, mask=None):
        """losses_at with sigma and noise drawn from key."""
        return self.losses_at(model_fn, x0, *self.draw(key, x0), mask)

    def sample(self, model_fn, noise, key, steps, method="heun", return_trajectory=False):
        """Heun (their alg. 1) or Euler from SIGMA_MAX * noise down `steps` rho-schedule levels to
        SIGMA_MIN, then D; key unused."""
        check_sampler(self, steps, method)
        hi, lo = self.SIGMA_MAX ** (1 / self.RHO), self.SIGMA_MIN ** (1 / self.RHO)
        sigmas = (hi + jnp.linspace(0.0, 1.0, steps) * (lo - hi)) ** self.RHO  # (steps,)
        denoise = lambda x, s: self.denoise(model_fn, x, jnp.full((x.shape[0],), s))  # noqa: E731
        slope = lambda x, s: (x - denoise(x, s)) / s  # noqa: E731  dx/dsigma
        x, trajectory = integrate(slope, noise * self.SIGMA_MAX, sigmas, method, return_trajectory)
        x = denoise(x, sigmas[-1])
        return (x, jnp.concatenate([noise[None], trajectory, x[None]])) if return_trajectory else x

# The objectives, by the name that --objective and the checkpoints give.
OBJECTIVES = {objective.name: objective for objective in (RectifiedFlow, GaussianDiffusion, EDM)}

def make_objective(name, **options):
    """The objective `name`, from its SETTINGS among `options`; the others are ignored."""
    if name not in OBJECTIVES:
        raise InputError(f"unknown objective {name!r}; use one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name](**{k: v for k, v in options.items() if k in OBJECTIVES[name].SETTINGS})

def objective_record(objective):
    """An objective's name and SETTINGS, as checkpoints record them."""
    return {"name": objective.name, **{k: getattr(objective, k) for k in objective.SETTINGS}}

#################################################################################
#                              11. Deferred masking                             #
#################################################################################
# MicroDiT's cheaper training step (Sehwag et al. 2024, "Stretching Each Dollar: Diffusion Training
# from Scratch on a Micro-Budget", Sec. 3): a patch-mixer sees every patch token; then a random
# share of the tokens is dropped, the backbone works on the rest and the loss counts only the kept
# patches. The paper reports that masking the input directly (MaskDiT without its decoder) loses
# quality at high ratios where masking after the mixer keeps it: each kept token already carries
# what the mixer gathered from the dropped ones. Sampling and validation see every patch.
#
# The mixer is the model's own first `mixer_depth` blocks (default 2), the backbone the rest. As in
# MicroDiT, the mixer's blocks are the backbone's, conditioned as they are (here adaLN-Zero on t and
# y, there also on the caption): what a token should gather from its neighbours before they are
# dropped depends on the noise level and the class, which plain transformer blocks would not see (a
# comparison with them is not measured here). Taking the mixer from the model's depth keeps the
# parameter count, and a model trained so is a plain DiTPlus: it samples, exports and loads as one.

@dataclasses.dataclass(frozen=True)
class DeferredMasking:
    """Drops `mask_ratio` of each image's tokens after the first `mixer_depth` blocks."""
    mask_ratio: float
    mixer_depth: int

    def kept(self, T):
        """How many of the T tokens the backbone sees."""
        return max(1, round(T * (1 - self.mask_ratio)))

    def draw(self, key, model, B):
        """(kept patches (B, T_keep), random per image; the loss's mask (B, H, W, 1)) from key."""
        T, p = model.cfg.grid ** 2, model.cfg.patch_size
        order = jnp.argsort(jax.random.uniform(key, (B, T)), axis=1)      # random, per image
        keep = order[:, :self.kept(T)]                                      # (B, T_keep)
        return keep, model.unpatchify(jnp.ones((B, keep.shape[1], p * p)), keep)

#################################################################################
#             12. Auxiliary losses: the model's own representations             #
#################################################################################
# Terms that train an intermediate block's tokens beside the objective's loss, none with weights
# from outside. Each is a frozen dataclass: `name` (its key in the metrics), `weight`, `taps` (the
# blocks whose tokens it reads, forward's) and a call on a Seen, which returns a scalar.
# TrainingLoss adds weight * term to the loss, and the metrics log each weighted term under "aux"
# by its name. A new term is one such class, and its switch in ModelOptions and a line in
# auxiliary_terms (sections 21 and 17).
# Defaults: the papers', their blocks scaled to DiT-S's 12 (README, "Representations").

@dataclasses.dataclass(frozen=True)
class Seen:
    """What a step's terms read, forward's intermediates `hidden` among them; `teacher` is the EMA,
    read-only."""
    objective: object
    model: nnx.Module
    teacher: nnx.Module
    x: jax.Array
    y: jax.Array  # the labels as the model saw them, some dropped
    t: jax.Array
    level: jax.Array
    noise: jax.Array
    uniform: jax.Array  # (B,) in [0, 1): the terms' random draws, one a sample
    mask: jax.Array | None
    keep: jax.Array | None
    mix: int
    hidden: dict

    def tokens(self, k):
        """The tokens after block k, and the patches they stand for or None."""
        return self.hidden[f"block{k}"], (self.keep if self.keep is not None and k > self.mix
                                          else None)

@dataclasses.dataclass(frozen=True)
class Dispersive:
    """Dispersive loss (Wang & He 2025): log of the batch's mean exp(-||z_i - z_j||^2 /
    (n temperature)), z the tokens after `block`."""
    block: int
    weight: float = 0.5
    temperature: float = 1.0
    name = "dispersive"
    # The one term over pairs of samples: with --grad-accum K, the mean of K terms, each over one
    # micro-batch's pairs, not the batch's term (pairs across micro-batches are never compared).

    @property
    def taps(self):
        return {self.block}

    def __call__(self, seen):
        z = seen.tokens(self.block)[0]
        z = z.reshape(z.shape[0], -1).astype(jnp.float32)                  # (B, n)
        sq = jnp.sum(z * z, axis=1)
        d = jnp.maximum(sq[:, None] + sq[None] - 2 * z @ z.T, 0) / z.shape[1]  # (B, B)
        return jax.nn.logsumexp(-d / self.temperature) - 2 * jnp.log(z.shape[0])

class ProjectionHead(nnx.Module):
    """SRA's head: Linear D -> 2D, SiLU, Linear 2D -> D."""

    def __init__(self, dim, *, dtype, rngs):
        self.fc1 = nnx.Linear(dim, 2 * dim, kernel_init=xavier, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(2 * dim, dim, kernel_init=xavier, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # (B, T, D) -> (B, T, D)
        return self.fc2(nnx.silu(self.fc1(x)))

@dataclasses.dataclass(frozen=True)
class SRA:
    """Self-representation alignment (Jiang et al. 2025): 1 - cosine, per token, of the student
    block through sra_head and the EMA's teacher block up to `offset` less noisy."""
    student: int
    teacher: int
    offset: float = 0.2
    weight: float = 0.5
    name = "sra"

    @property
    def taps(self):
        return {self.student}

    def __call__(self, seen):
        objective, (z, keep) = seen.objective, seen.tokens(self.student)
        lower = jnp.clip(seen.level - self.offset * seen.uniform, 0.0, 1.0)  # (B,)
        teacher = {}

        def teacher_fn(xt, t):  # the objective noises x as for training, at the teacher's times
            out, teacher["hidden"] = seen.teacher.forward(xt, t, seen.y, taps={self.teacher})
            return out
        objective.losses_at(teacher_fn, seen.x, objective.time_at(lower), seen.noise)
        target = jax.lax.stop_gradient(teacher["hidden"][f"block{self.teacher}"])  # (B, T, D)
        if keep is not None:  # the student saw the kept patches only
            target = jnp.take_along_axis(target, keep[..., None], axis=1)
        a = seen.model.sra_head(z).astype(jnp.float32)
        a, b = (v / jnp.linalg.norm(v, axis=-1, keepdims=True).clip(1e-6)
                for v in (a, target.astype(jnp.float32)))
        return jnp.mean(1 - jnp.sum(a * b, axis=-1))

@dataclasses.dataclass(frozen=True)
class Internal:
    """Internal guidance's term (Zhou et al. 2025): the objective's loss of the internal head's
    prediction."""
    weight: float = 0.5
    name = "internal"
    taps = frozenset()

    def __call__(self, seen):
        return seen.objective.losses_at(lambda xt, t: seen.hidden["internal"], seen.x, seen.t,
                                        seen.noise, seen.mask)["loss"].mean()

# Micro-batch k of K: samples k, k + K, k + 2K, ... of a batch (axis 0), so that over a mesh each
# holds as many of each device's share (K divides the share) and stays spread over the devices.
def micro_batch(a, k, K):
    return jax.lax.dynamic_index_in_dim(a.reshape(-1, K, *a.shape[1:]), k, 1, keepdims=False)

@dataclasses.dataclass(frozen=True)
class TrainingLoss:
    """The harness's batch_losses: the objective's over the kept patches, and each term's weight *
    term in "aux"."""
    masking: DeferredMasking | None = None
    terms: tuple = ()

    def __call__(self, objective, model, x, y, key, drop_key, ema, part=None):
        # `part` (k, K): the losses of micro_batch k of K. Every random number is drawn for the
        # whole batch, then the part taken: a sample sees the same in any micro-batch.
        drawn = {"x": x, "y": model.y_embedder.drop(y, drop_key) if model.cfg.num_classes else y,
                 "keep": None, "mask": None}
        if self.masking:
            key_keep, key = jax.random.split(key)
            drawn["keep"], drawn["mask"] = self.masking.draw(key_keep, model, x.shape[0])
        drawn["t"], drawn["noise"] = objective.draw(key, x)
        if self.terms:
            drawn["uniform"] = jax.random.uniform(jax.random.fold_in(key, 1), x.shape[:1])
        if part:
            drawn = jax.tree.map(lambda a: micro_batch(a, *part), drawn)
        x, y, keep, mask, t, noise = (drawn[k] for k in ("x", "y", "keep", "mask", "t", "noise"))
        mix = self.masking.mixer_depth if self.masking else 0
        taps, hidden = {k for term in self.terms for k in term.taps}, {}

        def model_fn(xt, t):  # called once; its intermediates stay for the terms
            out, hidden["of"] = model.forward(xt, t, y, None, taps, keep, mix)
            return out
        losses = objective.losses_at(model_fn, x, t, noise, mask)
        if self.terms:
            teacher = nnx.merge(nnx.graphdef(model), ema)
            seen = Seen(objective, model, teacher, x, y, t, losses["level"], noise,
                        drawn["uniform"], mask, keep, mix, hidden["of"])
            losses["aux"] = {term.name: term.weight * term(seen) for term in self.terms}
        return losses
#################################################################################
#                                                                               #
#                             PART III: THE HARNESS                             #
#                                                                               #
#################################################################################
# What connects the model and its objectives to the world: weight files, data, checkpoints, devices
# and hosts, evaluation, reports, the command line.

#################################################################################
#                                13. Weight files                               #
#################################################################################
# Official PyTorch checkpoints, read without torch, and safetensors files, read and written without
# the safetensors package. Both name a parameter as PyTorch does.

def flatten(tree):
    """{dotted path: leaf}: the names that checkpoints and weight files share."""
    return {jax.tree_util.keystr(path, simple=True, separator="."): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

WEIGHTS = nnx.Any(nnx.Param, nnx.BatchStat)  # what weight files hold: parameters, BatchNorm stats

def named_params(model):
    """{dotted path: array} of a model's weights, as flatten names them."""
    return flatten(nnx.to_pure_dict(nnx.state(model, WEIGHTS)))

# (graphdef, shapes) of cls(*args, **kwargs), nothing initialised, traced once a process for each
# configuration: tracing a model's initialisers takes from a tenth of a second to seconds, most of it
# in Flax's RNG counters, and a run reads one model's weights again at each checkpoint.
@functools.cache
def module_shapes(cls, *args, **kwargs):
    return nnx.split(nnx.eval_shape(lambda: cls(*args, **kwargs, rngs=nnx.Rngs(0))))

# cls(*args, **kwargs) with shapes for weights (module_shapes'), a module of its own to fill.
def abstract_module(cls, *args, **kwargs):
    return nnx.merge(*module_shapes(cls, *args, **kwargs), copy=True)

def set_params(model, named):
    """Set every weight of `model` from {dotted path: array}; the model may be nnx.eval_shape's."""
    state = nnx.state(model, WEIGHTS)
    like = nnx.to_pure_dict(state)
    leaves = [jnp.asarray(named[name], leaf.dtype) for name, leaf in flatten(like).items()]
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(jax.tree.structure(like), leaves))
    nnx.update(model, state)
    return model

# PyTorch's name for the last part of a weight's path where ours differs.
_TORCH_LEAF_NAMES = {"kernel": "weight", "embedding": "weight", "scale": "weight",
                     "mean": "running_mean", "var": "running_var"}

def torch_name(name):
    """The PyTorch key of our weight `name` (kernel -> weight, no nnx.Sequential 'layers')."""
    parts = [part for part in name.split(".") if part != "layers"]
    parts[-1] = _TORCH_LEAF_NAMES.get(parts[-1], parts[-1])
    return ".".join(parts)

def to_torch_layout(name, value, inverse=False):
    """Our layout -> PyTorch's (the reverse if `inverse`): linear kernels transposed, HWIO <->
    OIHW."""
    if not name.endswith("kernel"):
        return value
    axes = (2, 3, 1, 0) if inverse else (3, 2, 0, 1)
    return value.T if value.ndim == 2 else value.transpose(axes)

def load_torch_weights(model, state_dict, what, fix, names=None, skip=None):
    """Copy a PyTorch state dict into `model` by torch_name (or `names`); missing, unexpected
    (but `skip`'s) or misshapen keys raise InputError naming `what`."""
    ours = named_params(model)
    names = names or {torch_name(name): name for name in ours}
    missing = sorted(set(names) - set(state_dict))
    unexpected = sorted(k for k in set(state_dict) - set(names)
                        if not (skip and re.fullmatch(skip, k)))
    if missing or unexpected:
        show = lambda keys: f"{len(keys)} {keys[:6]}{' ...' if len(keys) > 6 else ''}"  # noqa: E731
        raise InputError(f"{what}: not the weights of this {type(model).__name__}: missing keys "
                         f"{show(missing)}, unexpected keys {show(unexpected)}; {fix}")
    values = {}
    for key, name in names.items():
        # a broadcast zero has the shape without the memory
        shape = to_torch_layout(name, np.broadcast_to(np.int8(0), ours[name].shape)).shape
        value = np.asarray(state_dict[key])
        if value.ndim == 4 and len(shape) == 2 and value.shape[2:] == (1, 1):
            value = value[:, :, 0, 0]
        if value.shape != shape:
            raise InputError(f"{what}: {key} has shape {list(value.shape)}, the "
                             f"{type(model).__name__} expects {list(shape)}; {fix}")
        values[name] = to_torch_layout(name, value, inverse=True)
    return set_params(model, values)

DIT_WEIGHTS_FIX = "it holds another model size or configuration"  # load_torch_weights' `fix`

def infer_dit_config(state_dict):
    """The DiTConfig of an official state dict's shapes (heads from the official sizes)."""
    D, C, p, _ = state_dict["x_embedder.proj.weight"].shape
    T = state_dict["pos_embed"].shape[1]
    depth = len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")})
    heads = {v["hidden_size"]: v["num_heads"] for v in DIT_SIZES.values()}.get(D)
    if heads is None:
        raise ValueError(f"hidden size {D} is not one of the official sizes, so the number of "
                         f"heads is unknown: pass a DiTConfig")
    out = state_dict["final_layer.linear.weight"].shape[0] // (p * p)
    table = state_dict.get("y_embedder.embedding_table.weight")
    return DiTConfig(input_size=math.isqrt(T) * p, patch_size=p, in_channels=C, hidden_size=D,
                     depth=depth, num_heads=heads, learn_sigma=out == 2 * C,
                     num_classes=0 if table is None else table.shape[0] - 1)

def load_dit_checkpoint(path, cfg: DiTConfig | None = None, **model_kwargs):
    """A DiTPlus (with the keyword arguments) of an official .pt checkpoint (train.py's: its EMA),
    configured from its shapes unless `cfg`."""
    state_dict = load_torch(path)
    if isinstance(state_dict, dict) and "ema" in state_dict:
        state_dict = state_dict["ema"]
    if not (isinstance(state_dict, dict) and "x_embedder.proj.weight" in state_dict
            and all(isinstance(v, np.ndarray) for v in state_dict.values())):
        raise InputError(f"{path} is not a DiT state dict (tensors with 'x_embedder.proj.weight')")
    if cfg is None:
        try:
            cfg = infer_dit_config(state_dict)
        except (KeyError, IndexError, ValueError, ArithmeticError) as e:  # shapes no DiT has
            raise InputError(f"{path}: the shapes of its weights are not those of an official "
                             f"DiT ({type(e).__name__}: {e}); from Python, pass "
                             f"load_dit_checkpoint its DiTConfig") from None
    model = abstract_module(DiTPlus, cfg, **model_kwargs)
    load_torch_weights(model, state_dict, path, DIT_WEIGHTS_FIX, skip="pos_embed")
    table = sincos_pos_embed_2d(cfg.hidden_size, cfg.grid)
    pos_embed = state_dict.get("pos_embed")
    if (pos_embed is None or pos_embed.shape != (1, *table.shape)
            or not np.allclose(pos_embed[0], table, atol=1e-5)):
        raise InputError(f"{path}: pos_embed is not the 2-D sin-cos table of a "
                         f"{cfg.grid}x{cfg.grid} grid")
    return model

#################################################################################
#                              14. The autoencoder                              #
#################################################################################
# DiT never sees pixels at 256x256: it models the 32x32x4 latents of the Stable Diffusion VAE
# (AutoencoderKL "kl-f8", released as stabilityai/sd-vae-ft-ema and sd-vae-ft-mse), here layer for
# layer as diffusers 0.42 builds it (diffusers/models/autoencoders/vae.py, unets/unet_2d_blocks.py,
# resnet.py, attention_processor.py) in NHWC; its weights load without torch or safetensors.

@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """The fields of diffusers' AutoencoderKL config that shape the network; defaults: SD VAE."""
    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    latent_channels: int = 4
    scaling_factor: float = 0.18215  # DiT multiplies latents by this for roughly unit variance

    @property
    def downsampling(self):  # pixels a latent spans along each side: 8 for the SD VAE
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_json(cls, path):
        """A diffusers config.json: keys that do not shape the network ignored, options not built
        here refused."""
        fix = "pass the config.json that came with the weights"
        raw = read_json(path, lambda c: isinstance(c, dict), "a diffusers config (an object)", fix)
        required = {"_class_name": "AutoencoderKL", "act_fn": "silu", "use_quant_conv": True,
                    "use_post_quant_conv": True, "mid_block_add_attention": True,
                    "shift_factor": None, "latents_mean": None}
        for key, want in required.items():
            if raw.get(key, want) != want:
                raise InputError(f"{path}: {key}={raw[key]!r} is not supported (only {want!r}, as "
                                 f"in the SD VAE)")
        for key, want in (("down_block_types", "DownEncoderBlock2D"),
                          ("up_block_types", "UpDecoderBlock2D")):
            blocks = raw.get(key, [want])
            if not isinstance(blocks, list) or any(t != want for t in blocks):
                raise InputError(f"{path}: {key}={blocks!r} is not supported (only {want})")
        kw = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
        channels, scale = kw.get("block_out_channels", [1]), kw.get("scaling_factor", 1.0)
        sizes = [v for k, v in kw.items() if k not in ("block_out_channels", "scaling_factor")]
        if not (isinstance(channels, list) and isinstance(scale, (int, float)) and scale > 0
                and all(type(v) is int and v > 0 for v in sizes + channels)):
            raise InputError(f"{path}: the sizes in it are not positive whole numbers, or "
                             f"scaling_factor is not a positive number; {fix}")
        if "block_out_channels" in kw:
            kw["block_out_channels"] = tuple(channels)
        try:
            return cls(**kw)
        except ValueError as e:  # __post_init__'s checks
            raise InputError(f"{path}: {e}; {fix}") from None

    def __post_init__(self):
        if (not self.block_out_channels
                or any(c % self.norm_num_groups for c in self.block_out_channels)):
            raise ValueError(f"block_out_channels {self.block_out_channels} must be non-empty "
                             f"multiples of norm_num_groups={self.norm_num_groups} (GroupNorm "
                             f"splits the channels into groups)")

def _group_norm(channels, groups, dtype, rngs):
    # two-pass variance like torch's GroupNorm; the one-pass E[x^2]-E[x]^2 loses digits on large
    # activations. flax computes the statistics in float32 whatever `dtype` is.
    return nnx.GroupNorm(channels, num_groups=groups, epsilon=1e-6, use_fast_variance=False,
                         dtype=dtype, rngs=rngs)

class VAEResnetBlock(nnx.Module):
    """diffusers ResnetBlock2D without time embedding: GroupNorm-SiLU-conv twice, a 1x1 shortcut."""

    def __init__(self, cin, cout, groups, *, dtype, rngs):
        self.norm1 = _group_norm(cin, groups, dtype, rngs)
        self.conv1 = nnx.Conv(cin, cout, (3, 3), padding=1, dtype=dtype, rngs=rngs)
        self.norm2 = _group_norm(cout, groups, dtype, rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), padding=1, dtype=dtype, rngs=rngs)
        self.conv_shortcut = (nnx.Conv(cin, cout, (1, 1), dtype=dtype, rngs=rngs) if cin != cout
                              else None)

    def __call__(self, x):  # (B, H, W, cin) -> (B, H, W, cout)
        h = self.conv1(nnx.silu(self.norm1(x)))
        h = self.conv2(nnx.silu(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + h

class VAEAttention(nnx.Module):
    """The mid-block self-attention over all H*W positions: one head, GroupNorm, residual."""

    def __init__(self, channels, groups, *, dtype, rngs):
        self.group_norm = _group_norm(channels, groups, dtype, rngs)
        self.to_q, self.to_k, self.to_v, self.to_out = (
            nnx.Linear(channels, channels, dtype=dtype, rngs=rngs) for _ in range(4))

    def __call__(self, x):  # (B, H, W, C)
        B, H, W, C = x.shape
        h = self.group_norm(x).reshape(B, H * W, C)
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)  # (B, HW, C) each
        scores = jnp.einsum("bqc,bkc->bqk", q, k).astype(jnp.float32) / np.sqrt(C)  # (B, HW, HW)
        # the softmax's sums in float32 also when the layers compute in bfloat16
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return x + self.to_out(jnp.einsum("bqk,bkc->bqc", weights, v)).reshape(B, H, W, C)

class VAEResample(nnx.Module):
    """Downsample2D (a stride-2 conv padded right and bottom only, as LDM's) or Upsample2D
    (nearest x2, then a conv)."""

    def __init__(self, channels, down, *, dtype, rngs):
        self.down = down
        self.conv = nnx.Conv(channels, channels, (3, 3), strides=2 if down else 1,
                             padding=((0, 1), (0, 1)) if down else 1, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # (B, H, W, C) -> (B, H/2, W/2, C) down, (B, 2H, 2W, C) up
        return self.conv(x if self.down else jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))

class VAEBlock(nnx.Module):
    """DownEncoderBlock2D or UpDecoderBlock2D: `n` ResnetBlocks, then a VAEResample if
    `resample`."""

    def __init__(self, cin, cout, n, groups, down, resample, *, dtype, rngs):
        self.resnets = nnx.List([VAEResnetBlock(cout if i else cin, cout, groups, dtype=dtype,
                                                rngs=rngs) for i in range(n)])
        self.samplers = "downsamplers" if down else "upsamplers"
        setattr(self, self.samplers, nnx.List([VAEResample(cout, down, dtype=dtype, rngs=rngs)]
                                              if resample else []))

    def __call__(self, x):
        for block in [*self.resnets, *getattr(self, self.samplers)]:
            x = block(x)
        return x

class VAEMidBlock(nnx.Module):
    """diffusers UNetMidBlock2D at the lowest resolution: ResnetBlock, attention, ResnetBlock."""

    def __init__(self, channels, groups, *, dtype, rngs):
        self.resnets = nnx.List([VAEResnetBlock(channels, channels, groups, dtype=dtype, rngs=rngs)
                                 for _ in range(2)])
        self.attentions = nnx.List([VAEAttention(channels, groups, dtype=dtype, rngs=rngs)])

    def __call__(self, x):
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))

class VAECoder(nnx.Module):
    """diffusers Encoder (image -> moments) or Decoder (latent -> image), whose mid block comes
    first and levels hold a ResnetBlock more."""

    def __init__(self, cfg, down, *, dtype, rngs):
        ch, g = cfg.block_out_channels[::1 if down else -1], cfg.norm_num_groups
        cin, cout = ((cfg.in_channels, 2 * cfg.latent_channels) if down
                     else (cfg.latent_channels, cfg.out_channels))
        self.down, self.levels = down, "down_blocks" if down else "up_blocks"
        self.conv_in = nnx.Conv(cin, ch[0], (3, 3), padding=1, dtype=dtype, rngs=rngs)
        self.mid_block = VAEMidBlock(cfg.block_out_channels[-1], g, dtype=dtype, rngs=rngs)
        setattr(self, self.levels, nnx.List([
            VAEBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block + (0 if down else 1), g, down,
                     i < len(ch) - 1, dtype=dtype, rngs=rngs)
            for i in range(len(ch))]))
        self.conv_norm_out = _group_norm(ch[-1], g, dtype, rngs)
        self.conv_out = nnx.Conv(ch[-1], cout, (3, 3), padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        levels = [*getattr(self, self.levels)]
        x = self.conv_in(x)
        for block in [*levels, self.mid_block] if self.down else [self.mid_block, *levels]:
            x = block(x)
        return self.conv_out(nnx.silu(self.conv_norm_out(x)))

class AutoencoderKL(nnx.Module):
    """diffusers AutoencoderKL in NHWC; DiT's latents are posterior samples times scaling_factor.
    Computes in `dtype`; parameters and outputs float32."""

    def __init__(self, cfg: VAEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        self.encoder = VAECoder(cfg, True, dtype=dtype, rngs=rngs)
        self.decoder = VAECoder(cfg, False, dtype=dtype, rngs=rngs)
        latent = cfg.latent_channels
        self.quant_conv = nnx.Conv(2 * latent, 2 * latent, (1, 1), dtype=dtype, rngs=rngs)
        self.post_quant_conv = nnx.Conv(latent, latent, (1, 1), dtype=dtype, rngs=rngs)

    def _check(self, x, channels, what):
        if x.ndim != 4 or x.shape[-1] != channels:
            raise ValueError(f"AutoencoderKL.{what} expects NHWC input with {channels} channels, "
                             f"got shape {tuple(x.shape)}; for NCHW pass x.transpose(0, 2, 3, 1)")

    def encode(self, x):
        """x (B, H, W, in) in [-1, 1] -> mean, logvar (B, H/f, W/f, latent), float32."""
        self._check(x, self.cfg.in_channels, "encode")
        with matmul_precision(self.dtype):
            moments = self.quant_conv(self.encoder(x)).astype(jnp.float32)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)  # as diffusers' DiagonalGaussianDistribution

    def decode(self, z):
        """Unscaled z (B, h, w, latent) -> image (B, h*f, w*f, out), float32."""
        self._check(z, self.cfg.latent_channels, "decode")
        with matmul_precision(self.dtype):
            return self.decoder(self.post_quant_conv(z)).astype(jnp.float32)

# --- The released VAE's weights ------------------------------------------------
def vae_torch_names(model):
    """{diffusers name: ours}: torch_name's, but diffusers' to_out.0."""
    return {torch_name(name).replace("to_out.", "to_out.0."): name for name in named_params(model)}

_OLD_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}

def load_vae_weights(model, tensors, source="the weight file"):
    """load_torch_weights of a diffusers state dict (numpy arrays, either attention naming)."""
    tensors = {re.sub(r"(attentions\.\d+\.)(query|key|value|proj_attn)\.",
                      lambda m: m.group(1) + _OLD_ATTENTION[m.group(2)] + ".", k): v
               for k, v in tensors.items()}
    return load_torch_weights(model, tensors, source, "is config.json the one that came with "
                              "these weights?", names=vae_torch_names(model))

def vae_dtype(precision):
    """The VAE's dtype at a sampling precision: the model's, but float32 for fp16, in which the SD
    VAE overflows."""
    return jnp.float32 if precision == "fp16" else compute_dtype(precision)

def released_vae(source, cache_dir=None, fetching=False):
    """The released VAE's folder, downloaded when missing."""
    folder = os.path.join(cache_dir or default_cache_dir(), f"sd-vae-ft-{source}")
    for fname in ("config.json", "diffusion_pytorch_model.safetensors"):
        url = f"https://huggingface.co/stabilityai/sd-vae-ft-{source}/resolve/main/{fname}"
        try:
            downloaded(url, os.path.join(folder, fname), fetching=fetching)
        except OSError as e:  # download's FileNotFoundError, with the cause
            raise InputError(f"cannot download {url} ({e}). Download config.json and "
                             f"diffusion_pytorch_model.safetensors of stabilityai/sd-vae-ft-"
                             f"{source} by hand into {folder}, or pass the folder or weight "
                             f"file as the VAE source.") from None
    return folder

def load_vae(source="ema", cache_dir=None, dtype=jnp.float32):
    """The AutoencoderKL in `dtype` from `source`: "ema" or "mse" (released_vae), a diffusers
    folder, or a weight file."""
    if source in ("ema", "mse"):
        source = released_vae(source, cache_dir)
    if os.path.isdir(source):
        found = [p for ext in ("safetensors", "bin")
                 if os.path.exists(p := os.path.join(source, f"diffusion_pytorch_model.{ext}"))]
        if not found:
            raise FileNotFoundError(f"{source} holds neither diffusion_pytorch_model.safetensors "
                                    f"nor .bin; put the VAE weights there or pass the weight file")
        weights, folder = found[0], source
    elif os.path.isfile(source):
        weights, folder = source, os.path.dirname(source)
    else:
        raise FileNotFoundError(f"VAE source {source!r} is not 'ema', 'mse', an existing folder or "
                                f"a weight file")
    config_path = os.path.join(folder, "config.json")
    cfg = VAEConfig.from_json(config_path) if os.path.exists(config_path) else VAEConfig()
    if weights.endswith(".safetensors"):
        tensors, _ = read_safetensors(weights)
    else:
        tensors = load_torch(weights)
        if not (isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(v, np.ndarray)
                                                  for k, v in tensors.items())):
            raise InputError(f"{weights} holds no plain state dict of tensors, diffusers' format")
    # A config.json can ask for any number of layers; building them takes time and memory.
    if cfg.layers_per_block * len(cfg.block_out_channels) > len(tensors):
        raise InputError(f"{weights} holds {len(tensors)} tensors, too few for the VAE of {cfg}; "
                         f"is config.json the one that came with these weights?")
    model = abstract_module(AutoencoderKL, cfg, dtype=dtype)
    return load_vae_weights(model, tensors, source=weights)

#################################################################################
#                                    15. Data                                   #
#################################################################################

@dataclasses.dataclass
class Dataset:
    """A training set in (or mapped into) host memory: uint8 pixels (N, H, W, C), or float16 latents
    (N, 2, h, w, 2*C), axis 1 [image, flip], the last [mean, std]."""
    name: str
    x: np.ndarray
    labels: np.ndarray | None  # int (N,); None for unconditional data
    num_classes: int  # 0 when unconditional
    class_names: list[str]
    latent_scale: float | None = None  # the VAE's scaling factor for latent data, None for pixels
    flip: bool = True  # random horizontal flips in training; off if not mirror-symmetric (digits)

    def __post_init__(self):
        if self.labels is not None and len(self.labels) != len(self.x):
            raise ValueError(f"dataset {self.name!r} has {len(self.x)} samples but "
                             f"{len(self.labels)} labels")
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"dataset {self.name!r} has {self.num_classes} classes but "
                             f"{len(self.class_names)} names")

    def __len__(self):
        return len(self.x)

    @property
    def is_latent(self) -> bool:
        return self.latent_scale is not None

    @functools.cached_property
    def sigma_data(self) -> float:
        """The data's std for EDM: 0.5 for pixels, else measured on up to 1,000 latents."""
        if not self.is_latent:
            return 0.5
        rng = np.random.default_rng(0)
        idx = np.sort(rng.permutation(len(self))[:1000])
        eps = rng.standard_normal((len(idx), *self.input_shape), dtype=np.float32)
        return float(self.inputs(idx, np.zeros(len(idx), bool), eps)[0].std())

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of a model input."""
        if self.is_latent:  # x is (N, 2, h, w, 2C)
            return (*self.x.shape[2:4], self.x.shape[4] // 2)
        return tuple(self.x.shape[1:])

    def inputs(self, idx, flip, eps=None):
        """x float32 (B, H, W, C), y int32 (B,) of samples idx, mirrored where flip; latents drawn
        with eps."""
        if self.is_latent:
            c = self.input_shape[-1]
            stats = np.asarray(self.x[idx, flip.astype(np.int64)], np.float32)  # (B, h, w, 2C)
            x = (stats[..., :c] + stats[..., c:] * eps) * np.float32(self.latent_scale)
        else:
            x = np.asarray(self.x[idx], np.float32) / 127.5 - 1.0  # (B, H, W, C)
            x[flip] = x[flip, :, ::-1]
        y = np.zeros(len(idx)) if self.labels is None else self.labels[idx]
        return x, np.asarray(y, np.int32)

def hold_out(n, k):
    """(training, held-out) indices, k of n held out by n and k alone, alike in every run."""
    perm = np.random.default_rng(0).permutation(n)
    return np.sort(perm[k:]), np.sort(perm[:k])

def default_data_dir(name: str) -> str:
    """Where a dataset lives (and is downloaded to) unless data_dir says otherwise."""
    return os.path.join(default_cache_dir(), "datasets", name)

# --- MNIST ---------------------------------------------------------------------
_MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_MNIST_MD5 = {  # images, then labels: the mirror's checksums, as torchvision's mnist.py lists them
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432"}

def _mnist_download(data_dir, fetching=False):
    return [downloaded(_MNIST_URL + name, os.path.join(data_dir, name), md5, "md5", fetching)
            for name, md5 in _MNIST_MD5.items()]

def _load_mnist(data_dir: str) -> Dataset:
    """MNIST's IDX files; the test digits stand in when alone."""
    for split in ("train", "t10k"):
        images, labels = (next((p for p in (stem, stem + ".gz") if os.path.exists(p)), None)
                          for stem in (os.path.join(data_dir, f"{split}-images-idx3-ubyte"),
                                       os.path.join(data_dir, f"{split}-labels-idx1-ubyte")))
        if images and labels:
            break
    else:
        images, labels = _mnist_download(data_dir)
    x, y = read_idx(images), read_idx(labels)
    if "t10k" in os.path.basename(images):
        print(f"note: {data_dir} holds only the MNIST test set; training on its {len(x):,} digits")
    if x.ndim != 3 or x.dtype != np.uint8:
        raise InputError(f"{images} holds {x.dtype} {x.shape}, not uint8 (N, H, W) images; is it a "
                         f"labels file?")
    if y.ndim != 1 or y.dtype != np.uint8 or (y.size and y.max() > 9):
        raise InputError(f"{labels} holds {y.dtype} {y.shape}, not uint8 (N,) digit labels 0-9")
    if len(x) != len(y):
        raise InputError(f"{images} holds {len(x)} images but {labels} holds {len(y)} labels; are "
                         f"they a pair?")
    return Dataset("mnist", x[..., None], y.astype(np.int64), 10, list("0123456789"), flip=False)

# --- CIFAR-10 ------------------------------------------------------------------
_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
_CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"
_CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["batches.meta"]

def _cifar10_download(data_dir, fetching=False):
    return downloaded(_CIFAR_URL, os.path.join(data_dir, "cifar-10-python.tar.gz"), _CIFAR_MD5,
                      "md5", fetching)

def _load_cifar10(data_dir: str) -> Dataset:
    """CIFAR-10's 50,000 training images, extracted or from the (downloaded) archive."""
    for where in (os.path.join(data_dir, "cifar-10-batches-py"), data_dir):
        if os.path.exists(os.path.join(where, "data_batch_1")):
            found = {}
            for name in _CIFAR_FILES:
                path = os.path.join(where, name)
                if not os.path.exists(path):
                    raise FileNotFoundError(f"{where} lacks {name}; extract "
                                            f"cifar-10-python.tar.gz again")
                with open(path, "rb") as f:
                    found[name] = _unpickle_cifar(f, path)
            break
    else:
        where = _cifar10_download(data_dir)
        try:
            with (_CappedGzip(where, _CIFAR_MAX_BYTES) as gz,
                  tarfile.open(fileobj=gz, mode="r:") as tar):
                # in archive order: seeking back in a gzip stream would decompress it again
                found = {os.path.basename(m.name): _unpickle_cifar(tar.extractfile(m),
                                                                   f"{where}:{m.name}")
                         for m in tar if m.isfile() and os.path.basename(m.name) in _CIFAR_FILES}
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:  # OSError: not gzip
            raise InputError(f"{where} is damaged ({e}); delete it and download it again") from None
        if missing := [name for name in _CIFAR_FILES if name not in found]:
            raise InputError(f"{where} lacks {', '.join(missing)}; is it the python version of "
                             f"CIFAR-10 ({_CIFAR_URL})?")
    xs, ys = [], []
    for name in _CIFAR_FILES[:5]:
        data, labels = found[name].get("data"), found[name].get("labels")
        if (not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2
                or data.shape[1] != 3072):
            raise InputError(f"{where}: {name} has no uint8 (n, 3072) 'data' array; is this "
                             f"the python version of CIFAR-10?")
        if not (isinstance(labels, list) and len(labels) == len(data)
                and all(type(label) is int and 0 <= label <= 9 for label in labels)):
            raise InputError(f"{where}: {name} has {len(data)} images but its labels are not "
                             f"{len(data)} classes in 0-9")
        xs.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # channel-major rows -> NHWC
        ys.append(np.asarray(labels))
    names = found["batches.meta"].get("label_names")
    if not (isinstance(names, list) and len(names) == 10
            and all(isinstance(n, (bytes, str)) for n in names)):
        raise InputError(f"{where}: batches.meta does not name CIFAR-10's 10 classes")
    names = [n.decode("latin1") if isinstance(n, bytes) else n for n in names]
    return Dataset("cifar10", np.ascontiguousarray(np.concatenate(xs)),
                   np.concatenate(ys).astype(np.int64), 10, names)

# --- Image folder --------------------------------------------------------------
IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpg", ".jpeg", ".pgm", ".png", ".ppm", ".tif", ".tiff",
                    ".webp")

def image_files(folder):
    """(images directly in `folder`, {sub-folder: its images at any depth}), sorted; names starting
    with "." are skipped."""
    def images(root, names):
        return [os.path.join(root, n) for n in names
                if not n.startswith(".") and n.lower().endswith(IMAGE_EXTENSIONS)]

    names = sorted(os.listdir(folder))
    subfolders = {}
    for name in names:
        if os.path.isdir(os.path.join(folder, name)) and not name.startswith("."):
            found = []
            for root, dirs, files in os.walk(os.path.join(folder, name)):
                dirs[:] = [d for d in dirs if not d.startswith(".")]  # pruned: not walked
                found += images(root, files)
            subfolders[name] = sorted(found)
    return [p for p in images(folder, names) if os.path.isfile(p)], subfolders

def center_crop_arr(pil_image, image_size):
    """ADM's and DiT's centre crop: BOX-halve, BICUBIC-resize the short side to image_size, cut the
    centre: uint8 (S, S, 3)."""
    if not (isinstance(image_size, (int, np.integer)) and image_size > 0):
        raise ValueError(f"image_size must be a positive int, got {image_size!r}")
    # RGB first, as DiT's loader converts; PIL would otherwise resize palette images NEAREST
    if pil_image.mode != "RGB":
        pil_image = pil_image.convert("RGB")
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size),
                                 resample=Image.BICUBIC)
    arr = np.asarray(pil_image)  # (H, W, 3), short side == image_size
    top, left = ((side - image_size) // 2 for side in arr.shape[:2])
    return arr[top:top + image_size, left:left + image_size]

def load_image(path, size=None):
    """(RGB uint8 (H, W, 3), None), cropped if `size`, or (None, reason) for a broken file:
    reported, not fatal."""
    try:
        with Image.open(path) as img:
            img.load()  # decode now: a truncated file fails here, not halfway through the crop
            return (center_crop_arr(img, size) if size else np.asarray(img.convert("RGB"))), None
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds on malformed files
        return None, f"{type(e).__name__}: {e}"

def _load_folder(data_dir: str, resolution: int | None) -> Dataset:
    """Every image under data_dir, cropped to a resolution if given: a class per sub-folder, or
    none."""
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"image folder {data_dir} does not exist")
    loose, subfolders = image_files(data_dir)
    class_names = list(subfolders)
    if class_names:
        files, labels = [], []
        for label, (name, found) in enumerate(subfolders.items()):
            if not found:
                warnings.warn(f"class folder {os.path.join(data_dir, name)} holds no images; class "
                              f"{label} ({name!r}) will have no training samples")
            files += found
            labels += [label] * len(found)
        if loose:
            warnings.warn(f"{len(loose)} images directly in {data_dir} are ignored: with class "
                          f"sub-folders, every image must be in one of them")
    else:
        files, labels = loose, None
    if not files:
        raise InputError(f"{data_dir} holds no images ({', '.join(IMAGE_EXTENSIONS)}), neither "
                         f"directly nor in class sub-folders")

    x, kept, broken = None, [], []
    crop = "pass a resolution (--resolution) to centre-crop every image to one size"
    pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1))  # PIL releases the GIL while decoding
    try:
        decoded = pool.map(lambda path: load_image(path, resolution), files)
        for i, (arr, problem) in enumerate(tqdm(decoded, total=len(files),
                                                desc=f"decoding {data_dir}")):
            if problem:
                broken.append(f"{files[i]} ({problem})")
                continue
            if x is None:
                if arr.shape[0] != arr.shape[1]:
                    raise InputError(f"{files[i]} is {arr.shape[1]}x{arr.shape[0]}, not square; "
                                     f"{crop}")
                x = np.empty((len(files),) + arr.shape, np.uint8)  # (N, H, W, 3)
            elif arr.shape != x.shape[1:]:
                raise InputError(f"{files[i]} is {arr.shape[1]}x{arr.shape[0]} but "
                                 f"{files[kept[0]]} is {x.shape[2]}x{x.shape[1]}; {crop}")
            x[len(kept)] = arr
            kept.append(i)
    finally:  # on an error, do not decode the rest of a large folder first
        pool.shutdown(cancel_futures=True)
    if broken:
        warnings.warn(f"skipped {len(broken)} unreadable image(s): " + "; ".join(broken[:10])
                      + (f"; and {len(broken) - 10} more" if len(broken) > 10 else ""))
    if not kept:
        raise InputError(f"none of the {len(files)} images in {data_dir} could be read")
    y = None if labels is None else np.asarray(labels, np.int64)[kept]
    return Dataset("folder", x[:len(kept)], y, len(class_names), class_names)

# --- ImageNet-100 --------------------------------------------------------------
def _load_imagenet100(data_dir: str, resolution: int | None) -> Dataset:
    """prepare_imagenet100.py's output, memory-mapped."""
    hint = (f"run `python prepare_imagenet100.py KAGGLE_DIR {data_dir}` on the Kaggle ImageNet-100 "
            f"download first (add --pixels 64 for pixel-space training), or pass --data-dir with "
            f"the folder it wrote")
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"no prepared ImageNet-100 at {data_dir}: {hint}")
    path = lambda name: os.path.join(data_dir, name)  # noqa: E731
    has_latents, has_images = (os.path.exists(path(n)) for n in ("latents.npy", "images.npy"))
    missing = [] if has_latents or has_images else ["latents.npy (or images.npy)"]
    missing += [n for n in ("labels.npy", "classes.json", "manifest.json")
                if not os.path.exists(path(n))]
    if missing:
        raise FileNotFoundError(f"{data_dir} lacks {', '.join(missing)}: {hint}")
    if has_latents and has_images:
        raise InputError(f"{data_dir} holds both latents.npy and images.npy; prepare latents and "
                         f"pixels into separate folders")
    fix = "prepare the data again with prepare_imagenet100.py"
    manifest = read_json(path("manifest.json"), lambda m: isinstance(m, dict)
                         and isinstance(m.get("resolution", 0), (int, type(None)))
                         and isinstance(m.get("scaling_factor", 0), (int, float, type(None))),
                         "the manifest that prepare_imagenet100.py writes", fix)
    if manifest.get("complete") is False:
        raise InputError(f"the preparation of {data_dir} did not finish; run "
                         f"prepare_imagenet100.py again with the same arguments to complete it")
    class_names = [c["name"] for c in read_json(
        path("classes.json"), lambda c: isinstance(c, list)
        and all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in c),
        'a list of {"wnid", "name"}', fix)]

    def memmap(name):  # a mapping reads nothing, and refuses a header claiming more than is there
        try:
            with np.errstate(over="ignore"):  # the overflow of a crafted shape is refused below
                return np.lib.format.open_memmap(path(name), mode="r")
        except ValueError as e:  # not .npy, objects, a damaged header, or shorter than it says
            raise InputError(f"{path(name)} is not a readable .npy file ({e}); {fix}") from None

    labels = memmap("labels.npy")
    x = memmap("latents.npy" if has_latents else "images.npy")
    if has_latents:
        if x.dtype != np.float16 or x.ndim != 5 or x.shape[1] != 2 or x.shape[-1] % 2:
            raise InputError(f"{path('latents.npy')} is {x.dtype} {x.shape}, not float16 "
                             f"(N, 2, h, w, 2*C); {fix}")
        if not (manifest.get("scaling_factor") or 0) > 0:
            raise InputError(f"{path('manifest.json')} lacks the VAE's scaling_factor; {fix}")
        latent_scale, stored = float(manifest["scaling_factor"]), manifest.get("resolution")
    else:
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or x.shape[1] != x.shape[2]:
            raise InputError(f"{path('images.npy')} is {x.dtype} {x.shape}, not uint8 "
                             f"(N, R, R, 3); {fix} --pixels R")
        latent_scale, stored = None, x.shape[1]
    if resolution is not None and stored is not None and resolution != stored:
        raise InputError(f"{data_dir} was prepared at resolution {stored}, not {resolution}; "
                         f"leave the resolution unset or prepare the data again at {resolution}")
    if (labels.shape != (len(x),) or labels.dtype.kind not in "iu"
            or (labels.size and not 0 <= labels.min() <= labels.max() < len(class_names))):
        raise InputError(f"{path('labels.npy')} does not hold {len(x)} labels in "
                         f"0-{len(class_names) - 1}; {fix}")
    return Dataset("imagenet100", x, labels.astype(np.int64), len(class_names), class_names,
                   latent_scale)

# --- Load any ------------------------------------------------------------------
def load_dataset(name: str, data_dir: str | None = None, resolution: int | None = None) -> Dataset:
    """mnist, cifar10, folder or imagenet100 from data_dir; resolution crops a folder's images."""
    if name == "folder":
        if data_dir is None:
            raise InputError("the 'folder' dataset needs a data_dir (--data-dir): a folder of "
                             "images, with one sub-folder per class or none")
        return _load_folder(data_dir, resolution)
    data_dir = data_dir or default_data_dir(name)
    native = {"mnist": 28, "cifar10": 32}.get(name)  # the size of all their images
    if native and resolution not in (None, native):
        raise InputError(f"{name} images are {native}x{native} and train at that size; leave the "
                         f"resolution unset, or export the images to a folder and use the 'folder' "
                         f"dataset to resize them")
    if name == "mnist":
        return _load_mnist(data_dir)
    if name == "cifar10":
        return _load_cifar10(data_dir)
    if name == "imagenet100":
        return _load_imagenet100(data_dir, resolution)
    raise ValueError(f"unknown dataset {name!r}; choose mnist, cifar10, folder or imagenet100")

# --- Loader --------------------------------------------------------------------
class Loader:
    """Endless stream of this process's share of each global batch, prefetched by threads; each
    batch a pure function of (seed, step)."""

    def __init__(self, ds: Dataset, global_batch: int, seed: int, start_step: int = 0,
                 process_index: int = 0, process_count: int = 1, prefetch: int = 2, subset=None):
        self.subset = np.arange(len(ds)) if subset is None else np.asarray(subset)
        if not 0 < global_batch <= len(self.subset):
            raise InputError(f"global batch {global_batch} must be between 1 and the number of "
                             f"training samples ({len(self.subset)})")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process {process_index} of {process_count} does not exist")
        if global_batch % process_count:
            raise InputError(f"global batch {global_batch} does not split evenly over "
                             f"{process_count} processes; make it a multiple of {process_count}")
        if seed < 0 or start_step < 0 or prefetch < 1:
            raise InputError(f"need seed >= 0, start_step >= 0 and prefetch >= 1, got {seed}, "
                             f"{start_step} and {prefetch}")
        self.ds, self.global_batch, self.seed, self.start_step = ds, global_batch, seed, start_step
        local = global_batch // process_count
        self.local_slice = slice(process_index * local, (process_index + 1) * local)
        self.steps_per_epoch = len(self.subset) // global_batch  # the last partial batch is dropped
        self._perm = (None, None)  # (epoch, its permutation): one tuple, so threads never see a mix
        self.prefetch, self._pool, self._closed = prefetch, None, False

    def indices(self, step: int) -> np.ndarray:
        """Dataset indices (G,) of this step's global batch."""
        epoch, position = divmod(step, self.steps_per_epoch)
        cached_epoch, perm = self._perm
        if cached_epoch != epoch:
            rng = np.random.default_rng((self.seed, epoch))
            perm = self.subset[rng.permutation(len(self.subset))]
            self._perm = (epoch, perm)
        return perm[position * self.global_batch:(position + 1) * self.global_batch]

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This process's (x, y) of one step."""
        ds, G, local = self.ds, self.global_batch, self.local_slice
        rng = np.random.default_rng((self.seed, step, 1))
        flip, eps = np.zeros(G, bool), None
        if ds.flip:
            flip = rng.integers(0, 2, G).astype(bool) if ds.is_latent else rng.random(G) < 0.5
        if ds.is_latent:
            eps = rng.standard_normal((G, *ds.input_shape), dtype=np.float32)[local]
        return ds.inputs(self.indices(step)[local], flip[local], eps)

    def __iter__(self):
        if self._pool is not None:
            raise RuntimeError("a Loader can be iterated only once; make a new one (with "
                               "start_step) to restart")
        # `prefetch` threads each compute one of the next batches; numpy's random fills, casts and
        # arithmetic release the GIL, so they run in parallel with each other and the training step
        self._pool = ThreadPoolExecutor(self.prefetch, thread_name_prefix="dit-data")
        steps = itertools.count(self.start_step)
        pending = deque(self._pool.submit(self.batch, next(steps)) for _ in range(self.prefetch))
        while True:
            if self._closed:
                raise RuntimeError("the data loader was closed; make a new one (with start_step) "
                                   "to go on")
            item = pending.popleft().result()  # re-raises here whatever went wrong in the thread
            pending.append(self._pool.submit(self.batch, next(steps)))
            yield item

    def close(self):
        """Stop the threads; batches under way finish."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

#################################################################################
#                                16. Checkpoints                                #
#################################################################################

def to_host(x):
    """A global array as one numpy array on this host."""
    if x.is_fully_addressable or x.is_fully_replicated:  # an explicit transfer, as jax counts it
        return jax.device_get(x.addressable_data(0) if x.is_fully_replicated else x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

def write_atomically(path, write):
    """Write `path` so that a crash leaves the old or the new file whole; a failure leaves no
    temporary."""
    # Named per host and process: hosts that share a folder can have equal process ids.
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename == tmp:  # named as the user named it
            raise OSError(e.errno, e.strerror, path) from None
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)

def writable(path, folder=False):
    """`path` with its folder (folder=True: itself) made and written in, or an InputError."""
    # Called before the work whose output it is to hold, which a path refused afterwards would lose.
    where = path if folder else os.path.dirname(path) or "."
    if not folder and os.path.isdir(path):
        raise InputError(f"cannot write {path}: it is a folder; give the path of a file")
    try:
        os.makedirs(where, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):  # a write: what refuses root too (a read-only disk)
            pass
    except OSError as e:
        found = where  # what stands in the way: the deepest part of the path that exists
        while not os.path.lexists(found):
            found = os.path.dirname(found) or "."
        why = (f"{found} is not a folder" if not os.path.isdir(found)
               else f"no file can be made in {found} ({e.strerror})")
        raise InputError(f"cannot write {path}: {why}") from None
    return path

def save_checkpoint(run_dir, state, meta, keep, local_disks=False, keep_ema=()):
    """Save checkpoints/step_XXXXXXX.npz, keep the newest `keep`, return its path; at `keep_ema`'s
    steps the EMA in ema/ too. A failed write ends all processes."""
    arrays = {name: to_host(leaf) for name, leaf in flatten(state).items()}  # every process joins
    step = int(arrays["step"])
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    path = os.path.join(ckpt_dir, f"step_{step:07d}.npz")
    header = np.array(json.dumps({**meta, "step": step}))
    writes = local_disks or jax.process_index() == 0
    needs = header.nbytes + sum(a.nbytes + 1024 for a in arrays.values())  # 1024: .npy, zip headers
    failure, free = None, None
    if writes:
        try:
            os.makedirs(ckpt_dir, exist_ok=True)
            free = shutil.disk_usage(ckpt_dir).free
            if free < needs:  # refused before a byte is written, rather than by a full disk
                raise OSError("not enough space")
            write_atomically(path, lambda f: np.savez(f, __meta__=header, **arrays))
        except OSError as e:
            failure = e.strerror or str(e)
    # Every process learns whether every copy is whole, before any older one is deleted (so that
    # the hosts always have a checkpoint in common) and before any goes on alone.
    failed = (multihost_utils.process_allgather(np.int32(failure is not None))
              if jax.process_count() > 1 else [failure is not None])
    if failure:
        free = "" if free is None else f", {free / 1e6:,.1f} MB free"
        before = [os.path.basename(p) for p in list_checkpoints(run_dir)] or ["the start"]
        raise InputError(f"cannot write the checkpoint of step {step} in {ckpt_dir} ({failure}): "
                         f"it needs {needs / 1e6:,.1f} MB{free}; make room there (--keep N keeps "
                         f"fewer), then run the same command to continue from {before[-1]}")
    if any(failed):
        raise InputError(f"process {int(np.argmax(failed))} could not write the checkpoint of step "
                         f"{step}; its message says why")
    if writes:
        if step in keep_ema:
            os.makedirs(os.path.join(run_dir, "ema"), exist_ok=True)
            export_ema(path, os.path.join(run_dir, "ema", f"step_{step:07d}.safetensors"))
        for old in list_checkpoints(run_dir)[:-keep]:
            os.remove(old)
    return path

def list_checkpoints(run_dir):
    """Finished checkpoints, oldest first."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    return sorted(os.path.join(ckpt_dir, f) for f in names
                  if f.startswith("step_") and f.endswith(".npz"))

def read_checkpoint(path, names=None):
    """(metadata, arrays) of a checkpoint; only `names` if given."""
    fix = "if it is the newest of a run that crashed, delete it to resume from the one before"
    try:
        arrays = read_npz(path, None if names is None else ["__meta__", *names])
        meta = json.loads(str(arrays.pop("__meta__")))
    except InputError as e:
        raise InputError(f"{path} is not a readable DiT checkpoint "
                         f"({str(e).removeprefix(f'{path}: ')}); {fix}") from None
    except (KeyError, ValueError, RecursionError):  # no metadata, or not JSON
        meta = None
    if not isinstance(meta, dict):
        raise InputError(f"{path} is not a DiT checkpoint: it has no metadata; {fix}")
    return meta, arrays

# `array` (a host's, one device's, or already there) on `sharding`'s devices, each process placing
# its own devices' slices: device_put of a host's array would first compare it across all hosts,
# sending the whole of it over the network once per host.
def placed(array, sharding):
    if isinstance(array, jax.Array) and array.sharding == sharding:
        return array
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

# `tree`'s arrays whole on every device of the mesh: weights that every device reads.
def replicated(tree, mesh):
    return jax.tree.map(lambda a: placed(a, NamedSharding(mesh, P())), tree)

def restore_state(arrays, abstract_state, shardings, what):
    """Checkpoint arrays into a state of this structure and these shardings, on any device count."""
    names = flatten(abstract_state)
    missing = sorted(set(names) - set(arrays))
    if missing:
        raise InputError(f"{what} lacks {missing[:3]}...: it is from another model or optimizer")
    leaves = []
    for (name, like), sharding in zip(names.items(), jax.tree.leaves(shardings)):
        if arrays[name].shape != like.shape or arrays[name].dtype.kind not in "fiu":
            raise InputError(f"{what}: {name} is {arrays[name].dtype} {arrays[name].shape}, the "
                             f"model needs {like.dtype} {like.shape}: the checkpoint is from "
                             f"another model size, or damaged")
        leaves.append(placed(arrays[name].astype(like.dtype), sharding))
    return jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)

def sampled_params(model):
    """named_params without those that only training reads (SRA's projection head)."""
    return {k: v for k, v in named_params(model).items() if not k.startswith("sra_head.")}

def export_ema(ckpt_path, out_path):
    """The EMA weights as .safetensors, official names and layouts, the configuration in the
    metadata."""
    if not ckpt_path.endswith(".npz"):
        raise InputError(f"export takes a training checkpoint (.npz), not {ckpt_path}: `sample` "
                         f"reads the .safetensors and .pt files directly")
    model, _, meta = load_model(ckpt_path)  # the checkpoint's EMA weights
    tensors = {torch_name(name): to_torch_layout(name, np.asarray(value))
               for name, value in sampled_params(model).items()}
    table = sincos_pos_embed_2d(model.cfg.hidden_size, model.cfg.grid)
    tensors["pos_embed"] = table[None].astype(np.float32)
    meta = meta | {"model": meta["model"] | {"sra_head": False}}  # not among the weights
    header = {k: json.dumps(meta.get(k)) for k in ("model", "objective", "latent_scale", "step")}
    write_atomically(out_path, lambda f: write_safetensors(f, tensors, header))
    return out_path

#################################################################################
#                             17. The training loop                             #
#################################################################################

# What `python dit.py --dataset NAME` trains by default. ImageNet-100: the paper's DiT-S/2 setup
# (32x32x4 latents, batch 256, lr 1e-4, EMA 0.9999), 400K steps, rectified flow (`--objective ddpm`:
# the paper's DDPM). MNIST, the CPU demo `python dit.py` runs in minutes, was tuned by measurement
# (README, Quickstart): at this budget many small steps of a narrow model beat a few large ones of
# DiT-XS; lr 20x DiT's and an EMA warm-up make the first grid show trained weights.
PAPER_RECIPE = dict(size="S", patch=2, lr=1e-4, ema_decay=0.9999, ema_warmup=False, log_every=100,
                    final_fid=10_000)
RECIPES = {
    "imagenet100": PAPER_RECIPE | dict(batch_size=256, steps=400_000, ckpt_every=10_000,
                                       sample_every=10_000),
    "cifar10": PAPER_RECIPE | dict(batch_size=128, steps=200_000, ckpt_every=10_000,
                                   sample_every=5_000),
    "folder": PAPER_RECIPE | dict(batch_size=128, steps=100_000, ckpt_every=5_000,
                                  sample_every=5_000),
    "mnist": dict(size="XXS", patch=4, batch_size=32, lr=2e-3, ema_decay=0.999, ema_warmup=True,
                  steps=1_800, log_every=50, ckpt_every=600, sample_every=200, final_fid=0),
}

# Steps that `train --profile` traces, counted from the first this process runs (which compiles).
PROFILE_STEPS = range(10, 15)

class StepTrace:
    """`train --profile DIR`: traces PROFILE_STEPS after `start`; called before each step, after
    the last."""

    def __init__(self, directory, start, steps):
        self.directory = directory
        self.first, self.end = start + PROFILE_STEPS.start, start + PROFILE_STEPS.stop
        if directory and steps < self.end:
            raise InputError(f"--profile traces steps {self.first + 1} to {self.end}, after step "
                             f"{start} where this run starts; it ends at step {steps}")
        with on_every_host():  # each process writes its own trace
            if directory:
                writable(directory, folder=True)

    def __call__(self, step, state):
        if self.directory and step in (self.first, self.end):
            jax.block_until_ready(state)  # the trace holds exactly the steps between
            if step == self.first:
                jax.profiler.start_trace(self.directory)
            else:
                jax.profiler.stop_trace()

# The interval at which processes agree whether to stop: a flag's all-reduce waits for the step in
# flight, which would otherwise overlap the next one's dispatch. A lone process checks every step.
STOP_CHECK_EVERY = 10

def agreed(value, done):
    """The processes' largest `value`; 0 between checks."""
    if jax.process_count() > 1 and done % STOP_CHECK_EVERY:
        return 0
    return int(multihost_utils.process_allgather(np.int32(value)).max())

# The signals that stop a run with a checkpoint: Ctrl-C, a scheduler's or a notebook's end
# (SIGTERM), and the warnings that SLURM's `--signal` sends before a job's time limit.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

# Before a SLURM job's end a run stops with time to spare: twice the longest pause between steps so
# far (evaluations and the checkpoint; before the first, a checkpoint's bytes at a network disk's
# CHECKPOINT_SPEED), plus JOB_END_SLACK for the steps until the processes agree (STOP_CHECK_EVERY)
# and the minute by which SLURM may misjudge a job's time.
CHECKPOINT_SPEED, JOB_END_SLACK = 50e6, 90.0

class Stop:
    """A stop after a whole step, with a checkpoint: STOP_SIGNALS (Ctrl-C twice: at once),
    --time-limit, a SLURM job's end; handlers inside `with` alone."""

    def __init__(self, time_limit, job_end=None):
        self.start = time.monotonic()
        self.limit = self.start + (time_limit or math.inf)
        self.job_end, self.margin = job_end or math.inf, JOB_END_SLACK
        self.signal, self.previous = None, {}

    @property
    def deadline(self):
        """The earlier of --time-limit and the job's end less a margin."""
        return min(self.limit, self.job_end - self.margin)

    def paused(self, seconds):
        """Widen the margin to twice this pause."""
        self.margin = max(self.margin, JOB_END_SLACK + 2 * seconds)

    @contextlib.contextmanager
    def pause(self):
        """Time a pause between steps."""
        began = time.monotonic()
        yield
        self.paused(time.monotonic() - began)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self.request)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            # None: a handler that Python did not install, which it cannot put back
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def request(self, sig, frame):
        """The signal handler; it only notes the request, as printing could re-enter a write."""
        if self.signal == sig == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = sig

    def reason(self, done):
        """Why every process stops after step `done`; None: go on."""
        wanted = 0
        if self.signal:
            wanted = 3
        elif time.monotonic() > self.deadline:
            wanted = 2 if self.deadline == self.limit else 1
        return [None, "reached the SLURM job's end", "reached --time-limit",
                "interrupted"][agreed(wanted, done)]

    def past(self, share, done):
        """Whether `share` of the time to the deadline has passed."""
        past = time.monotonic() > self.start + share * (self.deadline - self.start)  # inf: never
        return bool(agreed(int(past), done))

    def last_step(self, start, done, steps):
        """The progress bar's total: `steps`, or the deadline's step at the speed so far."""
        now = time.monotonic()
        if self.deadline == math.inf:
            return steps
        left = max(self.deadline - now, 0.0) * (done - start) / (now - self.start)  # in steps
        return min(steps, done + int(left))

def slurm_time_left(text):
    """Seconds of squeue's %L, [days-][hours:]minutes:seconds; else None."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not match:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds

def slurm_job_end(environ):
    """time.monotonic() at this SLURM job's end; None outside one."""
    job = environ.get("SLURM_JOB_ID")
    if not job or not shutil.which("squeue"):
        return None
    asked = time.monotonic()
    try:
        out = subprocess.run(["squeue", "--noheader", "--jobs", job, "--format", "%L"],
                             capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return None
    left = slurm_time_left(out)
    return None if left is None else asked + left

def set_total(bar, total):
    """A running tqdm bar's new total, a notebook widget's too."""
    bar.total = total
    if hasattr(bar, "container"):
        bar.container.children[1].max = total

def duration(text):
    """--time-limit: 8h30m, 90m, 45s, 1h (seconds)."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text.strip())
    seconds = match and 3600 * int(match[1] or 0) + 60 * int(match[2] or 0) + int(match[3] or 0)
    if not seconds:
        raise argparse.ArgumentTypeError(f"expected a duration such as 8h30m, 90m or 45s, got "
                                         f"{text!r}")
    return seconds

# The notebooks that name themselves in the environment, the hours of their sessions, and where a
# run must be to outlive one (README, Notebooks). A Kaggle session (KAGGLE_KERNEL_RUN_TYPE
# "Interactive", or "Batch" for a saved version) keeps /kaggle/working alone: a version's as its
# output, an interactive session's where the notebook's Persistence setting keeps files. A Colab
# runtime keeps nothing but what it wrote to Google Drive.
KAGGLE_WORKING, COLAB_DRIVE = "/kaggle/working", "/content/drive"

def session_notes(run_dir, time_limit, platform, environ):
    """What a Kaggle or Colab session's end (by `environ`) would take of a run."""
    within = lambda root: os.path.abspath(run_dir).startswith(root + os.sep)  # noqa: E731
    if environ.get("KAGGLE_KERNEL_RUN_TYPE"):
        name, hours = "Kaggle", 9 if platform == "tpu" else 12
        lost = environ["KAGGLE_KERNEL_RUN_TYPE"] != "Batch" or not within(KAGGLE_WORKING)
        keeps = (f", unless it lies in {KAGGLE_WORKING} and is kept: as a saved version's output "
                 f"(Save & Run All), or by the notebook's Persistence setting (files; set before "
                 f"the session ends)")
    elif "COLAB_RELEASE_TAG" in environ or "COLAB_GPU" in environ:
        name, hours, lost = "Colab", 12, not within(COLAB_DRIVE)
        keeps = (f"; only Google Drive outlasts it: put --run-dir in {COLAB_DRIVE}/MyDrive after "
                 f"drive.mount('{COLAB_DRIVE}')")
    else:
        return []
    notes = [f"note: {name} deletes {run_dir} when this session ends{keeps} (README, "
             f"Notebooks)"] if lost else []
    if time_limit and time_limit > hours * 3600:
        notes.append(f"note: --time-limit {time_limit / 3600:.3g} h outlasts a {name} session here "
                     f"({hours} h), whose end would come before the run's checkpoint: give it "
                     f"less (README, Notebooks)")
    return notes

def setup_distributed(config):
    """Join a multi-host run's processes, as --coordinator etc. say or a launcher's environment
    does (SLURM, Open MPI, a TPU pod slice)."""
    launched = (int(os.environ.get("SLURM_NTASKS", 1)) > 1
                or int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1)) > 1
                or os.environ.get("TPU_WORKER_HOSTNAMES", "localhost") != "localhost")
    if config.coordinator or config.num_processes:
        jax.distributed.initialize(config.coordinator, config.num_processes, config.process_id)
    elif launched:
        jax.distributed.initialize()

# The fewest samples of a batch that split_cpu gives each CPU device: below it, on 2 cores, the
# demo's model (XXS/4 on 28x28) trained slower split than whole.
CPU_SHARE = 8

def split_cpu(batch_size):
    """One JAX device per CPU core, each with at least CPU_SHARE samples of the batch, unless the
    user or a multi-host launch chose the devices (README, Speed)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    count = max(n for n in range(1, (cores or 1) + 1)
                if batch_size % n == 0 and (n == 1 or batch_size // n >= CPU_SHARE))
    chosen = ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
              or jax.config.jax_num_cpu_devices != -1 or jax.distributed.is_initialized())
    if count > 1 and not chosen:
        with contextlib.suppress(RuntimeError):  # JAX has started: its devices stay
            jax.config.update("jax_num_cpu_devices", count)

def use_compile_cache(directory):
    """JAX's persistent compilation cache in `directory` ("": none), keeping every program."""
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", bool(directory))
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

def check_batch_size(batch_size, grad_accum=1):
    """The global batch is split evenly over all devices of all hosts (and micro-batches)."""
    n = len(run_devices())
    if batch_size % n:
        raise InputError(f"--batch-size {batch_size} does not split over {n} devices; use a "
                         f"multiple of {n}")
    if (batch_size // n) % grad_accum:
        raise InputError(f"--grad-accum {grad_accum} does not split a device's {batch_size // n} "
                         f"samples (--batch-size {batch_size} over {n} devices) into equal "
                         f"micro-batches; use a divisor of {batch_size // n}")

def model_switches(config):
    """--arch's switches where not given, and internal guidance's block (8 of 28 of the depth)."""
    depth, block = DIT_SIZES[config.size]["depth"], config.internal_block
    return {**{k: on if getattr(config, k) is None else getattr(config, k)
               for k, on in ARCHS[config.arch].items()},
            "internal_block": (block or max(1, round(depth * 8 / 28))) if config.internal_guidance
            else block}

def model_config(config, input_size, in_channels, num_classes):
    """The DiTConfig of a train or bench configuration (ModelOptions) for this input."""
    switches = model_switches(config)
    block = switches.pop("internal_block")
    with errors_named(f"--patch {config.patch}"):
        return DiTConfig(input_size=input_size, patch_size=config.patch, in_channels=in_channels,
                         num_classes=num_classes, **DIT_SIZES[config.size], **switches,
                         learn_sigma=OBJECTIVES[config.objective].learn_sigma,
                         internal_block=block if config.internal_guidance else 0,
                         sra_head=config.sra)

def compute_dtype(precision):
    return {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[precision]

def default_precision(device=None):
    """bf16 on TPUs and NVIDIA GPUs from Ampere on, fp16 (loss-scaled) on Volta and Turing, fp32
    on CPUs and older GPUs."""
    device = device or run_devices()[0]
    if device.platform == "cpu" or not fp16_products(device):
        return "fp32"
    if device.platform == "gpu" and compute_capability(device) < 8.0:
        return "fp16"
    return "bf16"

# Whether XLA has float16 products with float32 sums on `device`: its GPU compiler has none before
# Volta (a P100: "Unsupported algorithm ALG_DOT_F16_F16_F32", in attention's logits).
def fp16_products(device):
    return device.platform != "gpu" or compute_capability(device) >= 7.0

# `config` with its precision: the device's default where none is given; fp16 where it compiles.
def with_precision(config):
    device = run_devices()[0]
    if config.precision == "fp16" and not fp16_products(device):
        raise InputError(f"--precision fp16: XLA has no float16 products with float32 sums on a "
                         f"{device.device_kind} (compute capability "
                         f"{compute_capability(device):g}); use fp32")
    return dataclasses.replace(config, precision=config.precision or default_precision(device))

# What the loop adds to section 6's training step: float16 loss scaling, gradient accumulation,
# the loss by noise level.

def loss_scale_state(dtype):
    """A float16 model's loss scaling state; none otherwise."""
    if dtype != jnp.float16:
        return {}
    return {"loss_scale": jnp.float32(2 ** 15), "good_steps": jnp.zeros((), jnp.int32)}

def scaled_grad(loss_fn, state):
    """loss_gradient with float16's loss scale: below 6e-5, small gradients would round to zero."""
    scale = state.get("loss_scale", 1.0)

    def scaled(params):
        loss, aux = loss_fn(params)
        return loss * scale, aux

    (_, aux), grads = jax.value_and_grad(scaled, has_aux=True)(state["params"])
    return jax.tree.map(lambda g: g / scale, grads), aux

def update_loss_scale(state, new_state, finite, period=2000):
    """Dynamic loss scaling (Micikevicius et al. 2018): an overflowed step is skipped, the scale
    halved; `period` good steps double it. The step count goes on either way."""
    keep = {**jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state),
            "step": new_state["step"]}
    good = jnp.where(finite, state["good_steps"] + 1, 0)
    scale = jnp.where(finite, jnp.where(good == period, 2.0, 1.0), 0.5) * state["loss_scale"]
    return keep | {"loss_scale": scale, "good_steps": good % period}

# `gradient` of K micro-batches in turn (TrainingLoss's `part`): their mean, the batch's gradient,
# and the batch's losses. A scan inside the one jitted step rather than optax.MultiSteps, which
# counts each micro-batch as an optimizer step: the step count, the EMA, the learning-rate
# schedule, the loader and the checkpoints would all have to learn about micro-steps.
def accumulated(gradient, K):
    def accumulated_gradient(loss_fn, state):
        def add(total, k):
            grads, losses = gradient(functools.partial(loss_fn, part=(k, K)), state)
            return jax.tree.map(jnp.add, total, grads), losses

        zero = jax.tree.map(jnp.zeros_like, state["params"])
        total, losses = jax.lax.scan(add, zero, jnp.arange(K))  # losses (K, B / K) or (K,)

        def whole(a):  # per sample: (K, B / K) back in the batch's order; a term's (K,): the mean
            return a.mean(0) if a.ndim == 1 else jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])
        return jax.tree.map(lambda g: g / K, total), jax.tree.map(whole, losses)

    return accumulated_gradient

# The loss is also logged over this many equal ranges of noise level: where the model is weak.
LOSS_BINS = 4

def jit_train_step(graphdef, objective, tx, ema_decay, ema_warmup, seed, mesh, shardings,
                   masking=None, terms=(), grad_accum=1):
    """make_train_step jitted on the mesh, with TrainingLoss, float16's loss scaling and LOSS_BINS
    losses by noise level."""
    gradient = scaled_grad if grad_accum == 1 else accumulated(scaled_grad, grad_accum)
    core_step = make_train_step(graphdef, objective, tx, ema_decay, seed, ema_warmup,
                                gradient=gradient, batch_losses=TrainingLoss(masking, terms))

    def train_step(state, x, y):
        new_state, metrics = core_step(state, x, y)
        losses = metrics.pop("losses")
        if "aux" in losses:
            metrics["aux"] = losses["aux"]
        bins = jnp.minimum((losses["level"] * LOSS_BINS).astype(jnp.int32), LOSS_BINS - 1)
        metrics |= {"loss_by_t": jax.ops.segment_sum(losses["loss"], bins, LOSS_BINS),
                    "count_by_t": jax.ops.segment_sum(jnp.ones_like(bins), bins, LOSS_BINS)}
        if "loss_scale" not in state:
            return new_state, metrics
        finite = jnp.isfinite(metrics["grad_norm"])
        return (update_loss_scale(state, new_state, finite),
                metrics | {"loss_scale": state["loss_scale"], "skipped": ~finite})

    batch = NamedSharding(mesh, P("data"))
    return jax.jit(train_step, in_shardings=(shardings, batch, batch),
                   out_shardings=(shardings, None), donate_argnums=0)

def device_memory(device):  # the bytes that JAX may take on it; None where it does not say (CPU)
    return (device.memory_stats() or {}).get("bytes_limit")

def size_text(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

# The training step of make_step(--grad-accum), checked against a device's memory at its first call
# (the jit keeps the program compiled for the check, for the calls after).
def fitting(make_step, config):
    step, checked = make_step(config.grad_accum), False

    def fitted(*args):
        nonlocal checked
        if not checked:
            check_memory(step, make_step, args, config)
            checked = True
        return step(*args)
    return fitted

# Ends the run in one line (step_memory's) where the training step does not fit a device.
def check_memory(step, make_step, args, config):
    limit = device_memory(jax.local_devices()[0])
    if not limit:
        return
    def compiled(k):  # the step of k micro-batches, compiled
        return (step if k == config.grad_accum else make_step(k)).lower(*args).compile()
    _, refusal = step_memory(compiled, config, limit)
    if refusal:
        raise InputError(refusal)

# (state and batch, working memory) in bytes a device of the program that compile() compiles (XLA's
# count); None where the compiler refuses it for memory (a TPU's).
def program_memory(compile):
    try:
        m = compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes,
            m.temp_size_in_bytes)

# A training step's memory on a device of `limit` bytes (XLA's count), and where it exceeds them,
# one line with what would fit: twice the micro-batches (compiled for the check) or more, --remat, a
# smaller batch. More micro-batches are estimated from K and 2K: their working memory, c + A K / k,
# has a part that scales with the micro-batch (activations) and one that does not (gradients, the
# optimizer's update). A TPU's compiler refuses a program larger than its memory: then each count of
# micro-batches is compiled in turn, until one fits. `compiled(k)`: the step of k micro-batches,
# compiled. Returns (bytes a device, or None where refused; None where it fits, else the line).
def step_memory(compiled, config, limit):
    count = lambda k: program_memory(lambda: compiled(k))  # noqa: E731
    counted, K = count(config.grad_accum), config.grad_accum
    if counted and sum(counted) <= limit:
        return sum(counted), None
    share, remedies = config.batch_size // len(run_devices()), []
    more = [k for k in (K * 2 ** i for i in range(1, share.bit_length())) if share % k == 0]
    if more and counted:
        fixed, work = counted
        scaled = 2 * (work - count(2 * K)[1])  # A
        need = {k: fixed + work - scaled + scaled * K / k for k in more}
    else:  # refused: compiled until one fits
        need = {}
        for k in more:
            need[k] = sum(count(k) or (math.inf,))
            if need[k] <= limit:
                break
    fits = [k for k in need if need[k] <= limit]
    remedies += [f"--grad-accum {fits[0]} (about {size_text(need[fits[0]])})"] if fits else []
    remedies += {None: ["--remat"], "dots": ["--remat full"]}.get(config.remat, [])
    needs = (f"needs {size_text(sum(counted))} of a device's {size_text(limit)} (XLA's count: "
             f"{size_text(counted[0])} of state and batch, {size_text(counted[1])} of working "
             f"memory" if counted else f"needs more than a device's {size_text(limit)} (XLA's "
             f"compiler refused it") + f" at {share // K} samples a device at a time)"
    return (sum(counted) if counted else None,
            f"the training step {needs}; try {', '.join([*remedies, 'a smaller --batch-size'])}")

def make_mesh():
    """A 1-D mesh "data" over all devices of all hosts."""
    devices = run_devices()
    return jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)

def state_shardings(abstract_state, mesh, fsdp):
    """The whole state on each device, or with fsdp each array split along its largest divisible
    dimension."""
    n = mesh.devices.size

    def spec(shape):
        dims = [d for d, size in enumerate(shape) if size % n == 0 and size >= n]
        if not (fsdp and dims):
            return P()
        largest = max(dims, key=lambda d: shape[d])
        return P(*[("data" if d == largest else None) for d in range(len(shape))])

    return jax.tree.map(lambda a: NamedSharding(mesh, spec(a.shape)), abstract_state)

# (init, graphdef, abstract state, shardings): a new state's maker, its model's graphdef, the
# state's shapes and shardings.
def state_maker(cfg, tx, seed, mesh, fsdp, dtype, remat):
    def init():
        model = DiTPlus(cfg, dtype=dtype, remat=remat, rngs=nnx.Rngs(seed))
        return new_train_state(model, tx) | loss_scale_state(dtype)
    abstract = jax.eval_shape(init)
    graphdef = module_shapes(DiTPlus, cfg, dtype=dtype, remat=remat)[0]
    return init, graphdef, abstract, state_shardings(abstract, mesh, fsdp)

def init_state(cfg, tx, seed, mesh, fsdp, dtype, remat, checkpoint=None):
    """(graphdef, state, shardings): the state made in its shardings, or read from `checkpoint`."""
    init, graphdef, abstract, shardings = state_maker(cfg, tx, seed, mesh, fsdp, dtype, remat)
    if checkpoint:
        state = restore_state(read_checkpoint(checkpoint)[1], abstract, shardings, checkpoint)
        print(f"resumed {checkpoint}")
    else:
        state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state, shardings

def deferred_masking(config, cfg):
    """The DeferredMasking of --mask-ratio and --mixer-depth for the model of cfg, or None."""
    if not config.mask_ratio:
        return None
    if not 0 < config.mask_ratio < 1:
        raise InputError(f"--mask-ratio {config.mask_ratio:g}: the share of patches dropped lies "
                         f"in [0, 1)")
    if config.mixer_depth >= cfg.depth:
        raise InputError(f"--mixer-depth {config.mixer_depth} leaves none of the model's "
                         f"{cfg.depth} blocks to the backbone; use fewer")
    return DeferredMasking(config.mask_ratio, config.mixer_depth)

def auxiliary_terms(config, cfg):
    """The terms of section 12 that the options switch on, checked against the model's depth."""
    def block(k, option):
        if not 1 <= k <= cfg.depth:
            raise InputError(f"{option} {k}: the model has blocks 1 to {cfg.depth}")
        return k
    terms = []
    if config.dispersive:
        k = block(config.dispersive_block or cfg.depth, "--dispersive-block")
        terms.append(Dispersive(k, config.dispersive_weight, config.dispersive_temperature))
    if config.sra:
        student = max(1, round(cfg.depth / 3))
        student, teacher = config.sra_blocks or (student, min(cfg.depth, max(
            student + 1, round(2 * cfg.depth / 3))))
        block(student, "--sra-blocks"), block(teacher, "--sra-blocks")
        if student >= teacher:
            raise InputError(f"--sra-blocks {student} {teacher}: the student block comes before "
                             f"the teacher's")
        terms.append(SRA(student, teacher, config.sra_offset, config.sra_weight))
    if config.internal_guidance:
        if not 1 <= cfg.internal_block < cfg.depth:
            raise InputError(f"--internal-block {cfg.internal_block}: the head goes after one of "
                             f"blocks 1 to {cfg.depth - 1}, before the final layer's")
        terms.append(Internal(config.internal_weight))
    return tuple(terms)

def open_run(config, cfg, ds, objective, masking, terms, local_disks):
    """(checkpoint to resume or None, checkpoint metadata). A new run directory gets run.json, and
    --resume's run's history; an existing one must hold the same run."""
    record = {**dataclasses.asdict(config), "dataset_size": len(ds), "num_classes": ds.num_classes,
              "masking": dataclasses.asdict(masking) if masking else None,
              "terms": {t.name: dataclasses.asdict(t) for t in terms} or None}
    record = json.loads(json.dumps(record))  # as run.json reads back: tuples as lists
    settings = run_settings(record)
    meta = {"model": dataclasses.asdict(cfg), "settings": settings, "class_names": ds.class_names,
            "unmask_at": config.unmask_at, "latent_scale": ds.latent_scale,
            "objective": objective_record(objective)}
    path, automatic = os.path.join(config.run_dir, "run.json"), config.resume in (None, "latest")
    with on_every_host():  # each host looks in its own --run-dir
        found = list_checkpoints(config.run_dir)
        checkpoint = (found or [None])[-1] if automatic else config.resume
        if config.resume and not (checkpoint and os.path.isfile(checkpoint)):
            where = "in " + config.run_dir if config.resume == "latest" else config.resume
            raise InputError(f"--resume: no checkpoint {where}")
        newer = [p for p in found if os.path.basename(p) > os.path.basename(checkpoint or "")]
        if newer:  # a later automatic resume would jump back to them, mixing two histories
            raise InputError(f"--resume {checkpoint}: {config.run_dir} holds newer checkpoints "
                             f"({os.path.basename(newer[-1])}); continue in another --run-dir, or "
                             f"move those away")
        if os.path.exists(path):
            old = read_json(path, lambda obj: isinstance(obj, dict), "the settings of a run",
                            "delete it to go on with this command's settings, or use another "
                            "--run-dir")
            # A setting missing from run.json is one that its run had off (0, None or False).
            diff = {k: (old.get(k), settings[k]) for k in settings
                    if (old.get(k) or None) != (settings[k] or None)}
            if diff:
                changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
                raise InputError(f"{config.run_dir} holds another run ({changes}). Use another "
                                 f"--run-dir, or the same settings to resume it.")
        # a new run directory that goes on from another run's checkpoint goes on with its history
        before = None if automatic or os.path.exists(path) else run_of(checkpoint)
    writes = local_disks or jax.process_index() == 0
    with on_every_host():  # a host that cannot copy the history ends them all
        if writes and not os.path.exists(path):
            if before:  # before run.json, which marks the directory as ready
                step = read_checkpoint(checkpoint, names=[])[0]["step"]
                copied = copy_history(before, config.run_dir, step)
                if jax.process_index() == 0:
                    print(f"continues {before} at step {step}: its metrics, grids and kept EMA "
                          f"weights up to there copied (files: {copied['samples']} in samples/, "
                          f"{copied['ema']} in ema/)")
            write_atomically(path, lambda f: f.write(json.dumps(record, indent=1).encode()))
    # Agreed before restoring, itself collective: hosts restoring different files would never meet.
    checkpoint = agree_on_checkpoint(config.run_dir, checkpoint, automatic)
    ckpt_dir = os.path.join(config.run_dir, "checkpoints")
    if writes and os.path.isdir(ckpt_dir):
        for name in os.listdir(ckpt_dir):
            if ".npz.tmp" in name:  # half-written by a save that a crash interrupted
                os.remove(os.path.join(ckpt_dir, name))
    return checkpoint, meta

def copy_history(source, run_dir, step):
    """Begin run_dir with `source`'s history up to `step` (metrics, samples/, ema/); `source` is
    only read. Returns the files copied by folder."""
    path = os.path.join(source, "metrics.jsonl")
    kept = [r for r in read_metrics(path) if r["step"] <= step] if os.path.isfile(path) else []
    text = "".join(json.dumps(r) + "\n" for r in [*kept, {"step": step, "continues": source}])
    write_atomically(os.path.join(run_dir, "metrics.jsonl"), lambda f: f.write(text.encode()))
    copied = {}
    for folder in ("samples", "ema"):
        src, dst = os.path.join(source, folder), os.path.join(run_dir, folder)
        names = [name for name in (os.listdir(src) if os.path.isdir(src) else [])
                 if (m := re.fullmatch(r"step_(\d+)\.\w+", name)) and int(m[1]) <= step]
        for name in names:
            os.makedirs(dst, exist_ok=True)
            # the contents alone: a read-only copy's modes would make the new run's files read-only
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
        copied[folder] = len(names)
    return copied

# --- Hosts' agreement ----------------------------------------------------------

# What a host finds on its own disk (a pod slice's hosts have one each) must not send it down
# another path through the collectives than the others, where they would wait for it for ever.

@contextlib.contextmanager
def on_every_host():
    """An InputError or OSError of the block on any process, raised on every process."""
    error = None
    try:
        yield
    except (InputError, OSError) as e:
        error = e
    if jax.process_count() > 1:
        raw = one_line(error).removeprefix("error: ").encode()[:1024] if error else b""
        # the message, cut and padded to a fixed size that every host gathers
        texts = multihost_utils.process_allgather(np.frombuffer(raw.ljust(1024, b"\0"), np.uint8))
        failed = np.flatnonzero(texts.any(axis=1))
        if len(failed):
            message = bytes(texts[failed[0]]).rstrip(b"\0").decode(errors="replace")
            raise InputError(f"process {failed[0]}: {message}") from None
    if error:
        raise error

def same_data_on_every_host(ds):
    """InputError unless every host reads the same dataset."""
    found = multihost_utils.process_allgather(np.array([len(ds), ds.num_classes,
                                                         *ds.input_shape], np.int32))
    if (found != found[0]).any():  # found: (processes, 5)
        each = ", ".join(f"{n} samples of {h}x{w}x{c} in {k} classes on process {i}"
                         for i, (n, k, h, w, c) in enumerate(found))
        raise InputError(f"the hosts found different data ({each}): copy the same data to every "
                         f"host (--data-dir)")

def run_dir_is_shared(run_dir):
    """Whether all processes see one run directory: process 0 writes a probe for the others to
    find."""
    # process 0's random name: a probe that a crashed run left behind is not taken for this one's
    token = np.random.default_rng().integers(2**31, dtype=np.int32)
    token = multihost_utils.broadcast_one_to_all(token)
    probe = os.path.join(run_dir, f".shared-{int(token)}")
    with on_every_host():
        try:
            writable(run_dir, folder=True)
            if jax.process_index() == 0:
                write_atomically(probe, lambda f: None)
        except OSError as e:
            raise InputError(f"cannot write in {run_dir} ({e.strerror or e}): the run's "
                             f"checkpoints go there; choose a --run-dir that can be "
                             f"written") from None
    multihost_utils.sync_global_devices("process 0 wrote the probe of the run directory")
    seen = multihost_utils.process_allgather(np.int32(os.path.exists(probe)))
    if jax.process_index() == 0:  # every process has looked: the gather waited for all
        os.remove(probe)
    if seen[1:].any() and not seen.all():
        raise InputError(f"some hosts see process 0's {run_dir} and others do not: make it a "
                         f"folder that all hosts share, or one on each host's own disk")
    return bool(seen.all())

# The run directories that this process's runs hold: a POSIX lock does not keep out the process
# that holds it (a notebook's second train() while the first still runs in a thread).
HELD_RUN_DIRS = set()

@contextlib.contextmanager
def holding(run_dir, local_disks):
    """RUN/lock, held by one run at a time."""
    # Locked by the processes that write the run directory (process 0, or every host on its own
    # disk); a run directory in use ends every host.
    # An fcntl lock ends with its process, a killed (-9) one too; NFS's lock manager (GPFS too, and
    # Lustre mounted with -o flock) holds it for every client of a shared folder. The file stays:
    # deleted, it would let a third run lock a new file while the second holds the old.
    path, key, lock = os.path.join(run_dir, "lock"), os.path.realpath(run_dir), None
    try:
        with on_every_host():
            if local_disks or jax.process_index() == 0:
                if key not in HELD_RUN_DIRS:  # checked first: closing a second copy lifts our lock
                    lock = open(path, "a+")
                    try:
                        import fcntl  # POSIX's: Windows has none
                        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except (BlockingIOError, PermissionError):  # held by another process
                        lock.close()
                        lock = None
                    except (OSError, ImportError) as e:  # a file system without locks (Lustre
                        # without -o flock), or Windows
                        print(f"note: {path} cannot be locked ({getattr(e, 'strerror', e)}): "
                              f"nothing but this note keeps a second run out of {run_dir}")
                if lock is None:
                    with open(path) as f:
                        holder = f.read().split()  # empty until its holder has written it
                    who = f"process {holder[1]} on {holder[0]}" if len(holder) == 2 else "a process"
                    raise InputError(f"{run_dir} is in use by the run of {who} (it holds {path}): "
                                     f"wait for it to end, or train in another --run-dir")
                lock.truncate(0)
                lock.write(f"{socket.gethostname()} {os.getpid()}\n")
                lock.flush()
                HELD_RUN_DIRS.add(key)
        yield
    finally:
        if lock is not None:
            HELD_RUN_DIRS.discard(key)
            lock.close()  # which lifts the lock

def agree_on_checkpoint(run_dir, checkpoint, automatic):
    """The checkpoint all processes resume from; on a disk per host, the newest that all have."""
    name = os.path.basename(checkpoint or "")
    names = multihost_utils.process_allgather(np.int32(zlib.crc32(name.encode()) >> 1))
    if (names == names[0]).all():
        return checkpoint
    if not automatic:
        raise InputError(f"--resume: the processes found different files at {checkpoint}")
    newest = multihost_utils.process_allgather(np.int32(int(name[5:12]) if name else -1))
    common = os.path.join(run_dir, "checkpoints", f"step_{newest.min():07d}.npz")
    have = multihost_utils.process_allgather(np.int32(os.path.isfile(common)))
    if newest.min() < 0 or not have.all():
        lacking = int(np.argmin(have)) if newest.min() >= 0 else int(np.argmin(newest))
        raise InputError(f"the hosts found different checkpoints in {run_dir} (newest steps "
                         f"{newest.tolist()}, process by process) and none that all have: copy "
                         f"the newest from process 0's host to process {lacking}'s, or use a "
                         f"folder that all hosts share")
    return common

# --- Metrics -------------------------------------------------------------------

class TensorBoard:
    """Records and grids as TensorBoard events in RUN_DIR/tensorboard, if tensorboard is
    installed."""

    def __init__(self, run_dir, start):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            print("note: the tensorboard package is not installed; the figures go to "
                  "metrics.jsonl only")
            self.writer = None
            return
        self.event, self.summary = event_pb2.Event, summary_pb2.Summary
        self.writer = EventFileWriter(os.path.join(run_dir, "tensorboard"))
        # A resume: TensorBoard drops what was logged from this event's step on, as MetricsLog does.
        start_log = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self.writer.add_event(self.event(wall_time=time.time(), step=start + 1,
                                         session_log=start_log))

    def write(self, step, values):  # from scalars and image, which check for a writer
        self.writer.add_event(self.event(wall_time=time.time(), step=step,
                                         summary=self.summary(value=values)))
        self.writer.flush()

    def scalars(self, record):
        """One scalar per number of the record, nested ones as "loss_t/0.00-0.25"."""
        if self.writer:
            flat = {key if name is None else f"{key}/{name}": v for key, value in record.items()
                    for name, v in (value.items() if isinstance(value, dict) else [(None, value)])}
            self.write(record["step"], [self.summary.Value(tag=k, simple_value=float(v))
                                        for k, v in flat.items()
                                        if isinstance(v, (int, float)) and k != "step"])

    def image(self, step, grid):
        if self.writer:
            png = io.BytesIO()
            grid.save(png, format="PNG")
            image = self.summary.Image(encoded_image_string=png.getvalue(), height=grid.height,
                                       width=grid.width, colorspace=len(grid.getbands()))
            self.write(step, [self.summary.Value(tag="samples", image=image)])

def read_metrics(path):
    """A metrics.jsonl's records, each with a whole "step"; other lines left out."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records

class MetricsLog:
    """A run's metrics.jsonl, written by process 0; a resumed run drops later records first. Metrics
    stay on the device until flush."""

    def __init__(self, run_dir, start, batch_size, schedule):
        self.path, self.batch_size, self.schedule = (os.path.join(run_dir, "metrics.jsonl"),
                                                     batch_size, schedule)
        self.pending, self.t0 = [], time.perf_counter()
        self.last = {}  # the newest value of each figure, for the summary of the run
        self.board = TensorBoard(run_dir, start) if jax.process_index() == 0 else None
        if jax.process_index() == 0 and os.path.exists(self.path):
            kept = "".join(json.dumps(r) + "\n" for r in read_metrics(self.path)
                           if r["step"] <= start)
            write_atomically(self.path, lambda f: f.write(kept.encode()))

    def write(self, record):
        self.last |= record
        if jax.process_index() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.board.scalars(record)

    def flush(self, done):
        """Write the record up to step `done`; stop at a non-finite loss or gradient but for
        float16's skipped steps."""
        pending = jax.device_get(self.pending)  # of steps done - len + 1 ... done
        for i, m in enumerate(pending):
            if not (np.isfinite(m["loss"]) and (m.get("skipped") or np.isfinite(m["grad_norm"]))):
                raise FloatingPointError(
                    f"the loss became {m['loss']} (gradient norm {m['grad_norm']}) at step "
                    f"{done - len(pending) + i + 1}; the last good checkpoint is kept in "
                    f"{os.path.dirname(self.path)}")
        seconds = (time.perf_counter() - self.t0) / len(pending)
        sums, counts = (sum(m[k] for m in pending) for k in ("loss_by_t", "count_by_t"))
        record = {"step": done, "loss": float(np.mean([m["loss"] for m in pending])),
                  "grad_norm": float(pending[-1]["grad_norm"]),
                  "loss_t": {f"{i / LOSS_BINS:.2f}-{(i + 1) / LOSS_BINS:.2f}":
                             float(sums[i] / counts[i]) if counts[i] else None
                             for i in range(LOSS_BINS)},
                  "lr": float(self.schedule(done - 1)), "images_per_s": self.batch_size / seconds,
                  "s_per_step": seconds}
        if "aux" in pending[-1]:  # each auxiliary term, weighted, by its name
            record["aux"] = {k: float(np.mean([m["aux"][k] for m in pending]))
                             for k in pending[-1]["aux"]}
        if "loss_scale" in pending[-1]:
            record |= {"loss_scale": float(pending[-1]["loss_scale"]),
                       "skipped_steps": int(sum(m["skipped"] for m in pending))}
        self.write(record)
        self.pending, self.t0 = [], time.perf_counter()
        return record

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (checkpoints, sample grids, FID) is not training time."""
        t = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - t

# --- The loop ------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """What training returns, one line in a notebook; `state` to go on from."""
    run_dir: str
    step: int
    loss: float | None
    fid: float | None
    stopped: str | None  # Stop.reason before the last step; None when the run finished
    config: "TrainConfig" = dataclasses.field(repr=False)  # with its defaults filled in
    state: dict = dataclasses.field(repr=False)

def params_line(model):
    """"N parameters", and those that sampling reads where fewer."""
    n, sampled = count_params(model), sum(v.size for v in sampled_params(model).values())
    return f"{n:,} parameters" + (f" ({sampled:,} at sampling)" if sampled != n else "")

def train(config):
    """Train a DiT as a TrainConfig says, resuming where it says."""
    # The devices, and the run directory, held by this run alone until it ends.
    config = with_defaults(checked(config))
    config = start_devices(config, config.batch_size // config.grad_accum)
    use_compile_cache(config.compile_cache)  # before anything compiles
    mesh = make_mesh()
    check_batch_size(config.batch_size, config.grad_accum)
    local_disks = not run_dir_is_shared(config.run_dir)  # made and written to, or refused
    with holding(config.run_dir, local_disks):  # to the end: the final FID and export too
        return train_in(config, mesh, local_disks)

def train_in(config, mesh, local_disks):
    """train's work, in its run directory."""
    # The data, and the model, objective and optimizer that fit it.
    if jax.process_index() == 0:  # told first, before the data and the model take their time
        for note in session_notes(config.run_dir, config.time_limit, jax.default_backend(),
                                  os.environ):
            print(note)
    with on_every_host():
        ds = load_dataset(config.dataset, config.data_dir, config.resolution)
    same_data_on_every_host(ds)
    H, W, C = ds.input_shape
    cfg = model_config(config, H, C, ds.num_classes)
    masking, terms = deferred_masking(config, cfg), auxiliary_terms(config, cfg)
    objective = make_objective(config.objective, timestep_sampling=config.timestep_sampling,
                               loc=config.ln_loc, scale=config.ln_scale, sigma_data=ds.sigma_data)
    tx, schedule = make_optimizer(config.lr, config.warmup, config.grad_clip, config.betas)
    train_idx, held_out = hold_out(len(ds), config.val_images)

    # The run directory, and the state: restored from a checkpoint, or new.
    stop = Stop(config.time_limit, slurm_job_end(os.environ))  # the time limit counts from here
    checkpoint, meta = open_run(config, cfg, ds, objective, masking, terms, local_disks)
    graphdef, state, shardings = init_state(cfg, tx, config.seed, mesh, config.fsdp,
                                            compute_dtype(config.precision), config.remat,
                                            checkpoint)
    stop.paused(sum(a.nbytes for a in jax.tree.leaves(state)) / CHECKPOINT_SPEED)
    if stop.job_end < math.inf and jax.process_index() == 0:
        print(f"SLURM job {os.environ['SLURM_JOB_ID']} ends in "
              f"{(stop.job_end - time.monotonic()) / 60:.1f} min: the run stops with a checkpoint "
              f"{stop.margin:.0f} s before (README, SLURM clusters)")
    start = int(to_host(state["step"]))
    trace = StepTrace(config.profile, start, config.steps)
    print(f"DiT-{config.size}/{config.patch} on {config.dataset} ({len(ds)} samples, input "
          f"{H}x{W}x{C}, "
          f"{ds.num_classes} classes): {params_line(nnx.merge(graphdef, state['params']))}, "
          f"{jax.device_count()} devices, {jax.process_count()} processes, "
          f"{config.precision}")
    log = MetricsLog(config.run_dir, start, config.batch_size, schedule)
    # Deferred masking's step before --unmask-at, the step on every patch after it (and throughout
    # without masking), each compiled and checked against the device's memory at its first step.
    masked, whole = (fitting(functools.partial(jit_train_step, graphdef, objective, tx,
                                               config.ema_decay, config.ema_warmup, config.seed,
                                               mesh, shardings, m, terms), config)
                     for m in (masking, None))
    # A share ends masking at that share of --steps or of the time to the Stop's deadline, whichever
    # comes first; checkpoints then keep the step as their unmask_at: a resumed run stays unmasked.
    share = config.unmask_at if isinstance(config.unmask_at, float) else None
    unmask_at = (config.steps if config.unmask_at is None
                 else math.ceil(share * config.steps) if share else config.unmask_at)
    ended = checkpoint and read_checkpoint(checkpoint, names=[])[0].get("unmask_at")
    unmasked = not masking or isinstance(ended, int) and ended <= start
    if masking and unmasked:
        meta["unmask_at"] = ended
    evaluator = Evaluator(config, cfg, graphdef, objective, mesh, ds, held_out)

    # The loop: a step on each global batch (from each process's share), then records, evaluations
    # and checkpoints at their intervals, until the end or a Stop (the same step on all processes).
    batch, stopped = NamedSharding(mesh, P("data")), None
    with (stop, tqdm(range(start, config.steps), initial=start, total=config.steps,
                     disable=jax.process_index() != 0) as bar,
          Loader(ds, config.batch_size, config.seed, start, jax.process_index(),
                 jax.process_count(),
                 subset=train_idx) as loader):
        for step, (x, y) in zip(bar, loader):
            trace(step, state)
            x = jax.make_array_from_process_local_data(batch, x, (config.batch_size, H, W, C))
            y = jax.make_array_from_process_local_data(batch, y, (config.batch_size,))
            if not unmasked and (step >= unmask_at or share and stop.past(share, step)):
                unmasked, meta["unmask_at"] = True, step
                log.write({"step": step, "unmasked": True})
                if jax.process_index() == 0:
                    why = (f"{share * 100:g}% of the {'steps' if step >= unmask_at else 'time'}"
                           if share else step)
                    print(f"step {step}: every patch from here on (--unmask-at {why})")
            state, metrics = (whole if unmasked else masked)(state, x, y)
            log.pending.append(metrics)
            done = step + 1
            set_total(bar, stop.last_step(start, done, config.steps))
            stopped = stop.reason(done) if done < config.steps else None
            last = done == config.steps or stopped
            if done % config.log_every == 0 or done % config.ckpt_every == 0 or last:
                record = log.flush(done)
                bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['images_per_s']:.0f}")
            with log.paused(), stop.pause():  # the checkpoint last: a resumed run keeps records
                evaluator(state["ema"], done, log)
                if done % config.ckpt_every == 0 or last:
                    saved = save_checkpoint(config.run_dir, state, meta, config.keep, local_disks,
                                            config.keep_ema)
            if stopped:
                break
    if stopped and jax.process_index() == 0:
        print(f"{stopped} at step {done} of {config.steps}: saved {saved}"
              f"{' (on every host)' if local_disks else ''}; the same command continues from there")

    # The end of a finished run: the final FID, the EMA weights on their own, and the time taken.
    if not stopped:
        trace(config.steps, state)
        if config.final_fid:
            evaluator.fid(state["ema"], config.steps, config.final_fid, log)
        # on each host that keeps checkpoints, so that `sample` can run on all as training did
        if (local_disks or jax.process_index() == 0) and list_checkpoints(config.run_dir):
            out = export_ema(list_checkpoints(config.run_dir)[-1],
                             f"{config.run_dir}/ema.safetensors")
            if jax.process_index() == 0:
                print(f"finished {config.steps} steps in {time.monotonic() - stop.start:.0f} s: "
                      f"grids in {config.run_dir}/samples, EMA weights in {out}"
                      f"{' (on every host)' if local_disks else ''}")
    return Run(config.run_dir, int(to_host(state["step"])), log.last.get("loss"),
               log.last.get("fid"), stopped, config, state)

#################################################################################
#                          18. Sampling and evaluation                          #
#################################################################################

def model_of_metadata(path, meta, arrays, dtype):
    """(abstract DiT, objective) that the file's metadata records, checked first: a file can claim
    anything."""
    def refuse(problem):
        return InputError(f"{path}: {problem}; the file is damaged or was not written by dit.py")
    # each field as JSON gives it back: a float may be written as an int, a tuple as a list
    kinds = {float: (int, float), tuple: list}
    fields = {f.name: kinds.get(type(f.default), type(f.default))
              for f in dataclasses.fields(DiTConfig)}
    config, settings, scale = (meta.get(k) for k in ("model", "objective", "latent_scale"))
    if not (isinstance(config, dict)
            and all(k in fields and isinstance(v, fields[k]) for k, v in config.items())):
        raise refuse("its metadata holds no DiT configuration")
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        cfg = DiTConfig(**config)  # which refuses a patch size that does not divide the input
    except (InputError, ArithmeticError) as e:  # ArithmeticError: a patch size of 0
        raise refuse(f"no DiT has the configuration it records ({e})") from None
    sizes = (cfg.input_size, cfg.patch_size, cfg.in_channels, cfg.hidden_size, cfg.num_heads)
    if (min(sizes) < 1 or not 0 <= cfg.depth <= arrays or cfg.num_classes < 0
            or not 0 < cfg.mlp_ratio < math.inf or not 0 <= cfg.class_dropout_prob < 1
            or cfg.hidden_size % 4 or cfg.hidden_size % cfg.num_heads
            or cfg.hidden_size // cfg.num_heads % 4
            or not 0 <= cfg.internal_block < max(cfg.depth, 1)):
        raise refuse(f"no DiT has the configuration it records, {cfg}")
    try:
        objective = make_objective(**settings)
    except (TypeError, KeyError, ValueError, AttributeError):
        raise refuse(f"its metadata records no objective of dit.py ({settings!r})") from None
    if objective.learn_sigma != cfg.learn_sigma:
        raise refuse(f"its objective ({objective.name}) and its model's outputs disagree on "
                     f"learn_sigma")
    if not (scale is None or isinstance(scale, (int, float)) and scale > 0):
        raise refuse(f"its latent_scale {scale!r} is not a positive number")
    return abstract_module(DiTPlus, cfg, dtype=dtype), objective

def load_model(path, dtype=jnp.float32):
    """(model, objective, metadata) of a training checkpoint (its EMA), an exported .safetensors or
    an official .pt."""
    if path.endswith(".npz"):
        meta, arrays = read_checkpoint(path)
        ema = {name[len("ema."):]: a for name, a in arrays.items() if name.startswith("ema.")}
        model, objective = model_of_metadata(path, meta, len(ema), dtype)
        wrong = [name for name, like in named_params(model).items() if name not in ema
                 or ema[name].shape != like.shape or ema[name].dtype.kind not in "fiu"]
        if wrong:
            raise InputError(f"{path}: its EMA weights do not fit the model its metadata records "
                             f"(e.g. ema.{wrong[0]}); the file is damaged")
        return set_params(model, ema), objective, meta
    if path.endswith(".safetensors"):
        tensors, raw = read_safetensors(path)
        try:
            meta = {key: json.loads(raw[key]) for key in ("model", "objective", "latent_scale")}
            meta["step"] = json.loads(raw.get("step", "null"))  # None where the file does not say
        except (KeyError, ValueError, RecursionError):
            raise InputError(f"{path} has no model configuration in its metadata; was it written "
                             f"by `dit.py export`?") from None
        model, objective = model_of_metadata(path, meta, len(tensors), dtype)
        load_torch_weights(model, tensors, path, DIT_WEIGHTS_FIX, skip="pos_embed")
        return model, objective, meta
    # The released checkpoints were trained with DDPM on SD-VAE latents.
    return (load_dit_checkpoint(path, dtype=dtype), GaussianDiffusion(),
            {"objective": {"name": "ddpm"}, "latent_scale": VAEConfig().scaling_factor})

def load_guide(path, cfg, objective, latent_scale, model_path, dtype=jnp.float32):
    """(model, metadata) in `path`, refused in one line where it cannot guide the model in
    model_path."""
    guide, guide_objective, guide_meta = load_model(path, dtype)
    a, b = cfg, guide.cfg
    differ = [f"{k.replace('_', ' ')} {getattr(b, k)} against {getattr(a, k)}"
              for k in ("input_size", "in_channels", "patch_size", "num_classes")
              if getattr(a, k) != getattr(b, k)]
    # what the sampler reads of the objective: its name, and EDM's preconditioning
    sampled = lambda o: f"{o.name}" + (f" (sigma_data {o.sigma_data})"  # noqa: E731
                                      if hasattr(o, "sigma_data") else "")
    differ += [f"{what} {theirs} against {ours}" for what, theirs, ours in (
        ("objective", sampled(guide_objective), sampled(objective)),
        ("latent scale", guide_meta.get("latent_scale"), latent_scale))
        if theirs != ours]
    if differ:
        raise InputError(f"{path} cannot guide {model_path}: {', '.join(differ)}; a guide "
                         f"is an earlier EMA of the same run (RUN/ema/) or a smaller model trained "
                         f"on the same data")
    return guide, guide_meta

def to_uint8(images):
    """Images in [-1, 1] -> uint8, rounded as the official sample_ddp.py."""
    return jnp.clip(127.5 * images + 128.0, 0, 255).astype(jnp.uint8)

def make_grid(images):
    """Tile uint8 images (N, H, W, C) into one square image, with 2-pixel gaps."""
    n, h, w, c = images.shape
    nrow = math.ceil(math.sqrt(n))
    grid = np.zeros((math.ceil(n / nrow) * (h + 2) + 2, nrow * (w + 2) + 2, c), np.uint8)
    for i, img in enumerate(images):
        r, q = divmod(i, nrow)
        grid[2 + r * (h + 2):2 + r * (h + 2) + h, 2 + q * (w + 2):2 + q * (w + 2) + w] = img
    return Image.fromarray(grid[..., 0] if c == 1 else grid)

def save_grid(images, path):
    """Save the grid of `images` as a PNG and return it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    grid = make_grid(images)
    grid.save(path)
    return grid

# Images each device decodes at a time, so that decoding's memory stays bounded whatever the
# sampling batch (README, Speed); 32 is the official sample_ddp.py's batch per GPU.
DECODE_CHUNK = 32

def load_decoder(source, channels, dtype):
    """The VAE `source` (load_vae's) that decodes a model's latents of `channels` channels."""
    vae = load_vae(source, dtype=dtype)
    if vae.cfg.latent_channels != channels:
        raise InputError(f"--vae {source}: its latents have {vae.cfg.latent_channels} channels, "
                         f"the model's {channels}; pass the VAE that encoded the training data")
    return vae

# (VAE weights, samples (B, h, w, C)) -> uint8 images (B, H, W, 3), jitted; pixels without a VAE.
# Samples are decoded and made uint8 on the device too: only bytes travel to the host. One program
# for each mesh and VAE, which every Sampler of them shares (a guidance sweep's).
@functools.cache
def decoder(mesh, vae_graphdef, latent_scale):
    batch = NamedSharding(mesh, P("data"))

    def decode(vae_params, z):  # (b, h, w, C): this device's share of the batch
        vae = nnx.merge(vae_graphdef, vae_params)
        one = lambda z: vae.decode(z[None])[0]  # noqa: E731  (h, w, C) -> (H, W, 3)
        return jax.lax.map(one, z, batch_size=DECODE_CHUNK)

    def finish(vae_params, x):
        if vae_params is not None:
            x = jax.shard_map(decode, mesh=mesh, in_specs=(P(), P("data")),
                              out_specs=P("data"))(vae_params, x / latent_scale)
        return to_uint8(x)

    return jax.jit(finish, in_shardings=(None, batch), out_shardings=batch)

# (weights, guide's weights, noise, labels, key, CFG scale) -> samples, jitted: one program for each
# model, guide, objective, mesh, sample()'s other options and whether CFG guides. The scale is an
# argument: a guidance sweep's scales share a program, which the run's next sweep reuses.
@functools.cache
def sampler_program(graphdef, guide_graphdef, objective, mesh, guided, options):
    batch = NamedSharding(mesh, P("data"))

    def run(params, guide_params, noise, y, key, cfg_scale):  # named, as compilation logs say
        guide = nnx.merge(guide_graphdef, guide_params) if guide_graphdef else None
        return sample(nnx.merge(graphdef, params), objective, noise, y, key, guide=guide,
                      cfg_scale=cfg_scale if guided else 1.0, **dict(options))

    return jax.jit(run, in_shardings=(None, None, batch, batch, None, None))

class Sampler:
    """uint8 samples from weights over the mesh, decoded DECODE_CHUNK a device at a time."""

    def __init__(self, graphdef, objective, mesh, *, vae=None, latent_scale=None, guide=None,
                 cfg_scale=1.0, **options):
        # options: sample()'s others (steps, method, guidance_channels, ..., return_trajectory)
        self.trajectory = options.get("return_trajectory", False)
        self.guide_params = (replicated(nnx.state(guide, nnx.Param), mesh)
                             if guide is not None else None)
        self.cfg_scale, self.mesh = np.float32(cfg_scale), mesh
        self.run = sampler_program(graphdef, nnx.graphdef(guide) if guide is not None else None,
                                   objective, mesh, guides(cfg_scale), tuple(sorted(options.items())))
        vae_graphdef, vae_params = nnx.split(vae) if vae is not None else (None, None)
        self.vae_params = replicated(vae_params, mesh)
        self.finish = decoder(mesh, vae_graphdef, latent_scale)
        self.seconds = {"sample": 0.0, "decode": 0.0, "Inception": 0.0}  # sample_and_score's

    def images(self, x):
        """Samples (B, H, W, C) -> uint8 images on this host."""
        return to_host(self.finish(self.vae_params, x))

    def __call__(self, params, noise, y, key):
        """Images of noise and labels; with return_trajectory, <= 60 frames (F, B, ...) too."""
        start = time.perf_counter()
        scale = jax.device_put(self.cfg_scale, NamedSharding(self.mesh, P()))
        out = jax.block_until_ready(self.run(params, self.guide_params, noise, y, key, scale))
        sampled = time.perf_counter()
        if self.trajectory:
            x, traj = out
            frames = np.linspace(0, len(traj) - 1, min(len(traj), 60)).round().astype(int)
            images = self.images(x), np.stack([self.images(traj[i]) for i in frames])
        else:
            images = self.images(out)
        self.seconds["sample"] += sampled - start
        self.seconds["decode"] += time.perf_counter() - sampled  # and the copy to the host
        return images

def device_multiple(n):
    """n rounded up to a multiple of the device count."""
    return math.ceil(n / jax.device_count()) * jax.device_count()

def spread_labels(n, num_classes):
    """Labels (n,) 0, 1, ..., K-1, 0, 1, ...: every class equally often."""
    return np.arange(n, dtype=np.int32) % max(num_classes, 1)

# The guidance scale of FID samples where one is fixed (train --fid-cfg-scale, sample --fid, bench
# --fid): the paper's best FID-50K, 2.27 for DiT-XL/2, was sampled at 1.5; its sample grids at 4.
FID_CFG_SCALE = 1.5
GRID_CFG_SCALE = 4.0

# A run's FID where no --fid-* option fixes its guidance: each setting here scored on a tenth of
# the FID's samples, the best then on all of them (Evaluator.fid). Public figures put a small
# model's best far above XL/2's 1.5 (README, Guidance): SiT-S/2's at CFG 3.5-4 on 3 of 4 channels,
# about 2.9-3.25 on all 4, which every setting here guides. (CFG scale, its interval on the 0..1000
# scale, autoguidance's weight by the run's kept EMA nearest half the step): unguided; CFG 1.5 to
# 4; CFG off above t = 0.75; autoguidance 2 and 3; CIFAR-10's best, CFG 1.5 with autoguidance 2.
# Network evaluations a sample and step: 1, 2 each, 3 for the last: the sweep's 20 at a tenth of
# the samples each cost what the paper's setting at all of them does (2 a sample).
FID_SWEEP = ((1.0, None, 1.0), (1.5, None, 1.0), (2.0, None, 1.0), (3.0, None, 1.0),
             (4.0, None, 1.0), (3.0, (0.0, 750.0), 1.0), (4.0, (0.0, 750.0), 1.0),
             (1.0, None, 2.0), (1.0, None, 3.0), (1.5, None, 2.0))

def count_label(n):
    """A sample count as figures name it: 10K, or 32."""
    return f"{n / 1000:g}K" if n and n % 1000 == 0 else f"{n:.0f}"

def fid_module():
    """fid.py, beside this file or run in a cell."""
    try:
        import fid
    except ModuleNotFoundError as e:
        if e.name != "fid":
            raise
        raise InputError("FID needs fid.py, which holds the Inception network: put it beside "
                         "dit.py, or paste its text into a notebook cell and run it") from None
    return fid

def sample_and_score(sampler, params, n, batch_size, shape, num_classes, seed, inception=None,
                     reference=None, save=None):
    """(uint8 images, labels, scores): the one path from weights to FID; labels spread evenly,
    `save` before scoring; each process scores its share."""
    labels = spread_labels(n, num_classes)
    chunks = []
    for i in tqdm(range(math.ceil(n / batch_size)), desc="sampling",
                  disable=jax.process_index() != 0):
        y = np.resize(labels[i * batch_size:(i + 1) * batch_size], batch_size)  # pad the last batch
        noise = jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), (batch_size, *shape))
        key = jax.random.fold_in(jax.random.key(seed + 1), i)
        chunks.append(sampler(params, noise, jnp.asarray(y), key))
    images = np.concatenate(chunks)[:n]
    if images.shape[-1] == 1:  # grayscale (MNIST): Inception and OpenAI's evaluator take RGB
        images = np.repeat(images, 3, axis=-1)
    if save:
        save(images, labels)
    if inception is None and reference is None:
        return images, labels, None
    start = time.perf_counter()
    share = images[jax.process_index()::jax.process_count()]
    scores = fid_module().evaluate(share, ref=reference, inception=inception)
    sampler.seconds["Inception"] += time.perf_counter() - start
    return images, labels, scores

def fid_record(scores):
    """metrics.jsonl's record of fid.evaluate's `scores`: the figures, their count and protocol."""
    rest = {k: v for k, v in scores.items() if np.ndim(v) == 0 and k not in ("count", "protocol")}
    return {"fid_samples": scores["count"], "fid_protocol": scores["protocol"], **rest}

# A guidance setting (guide: (path or None, weight)) as a row names it, and as a file name ends.
def guidance_names(scale, interval, guide, internal=1.0):
    path, w = guide
    text = f"guidance {scale:g}" + (f" in [{interval[0]:g}, {interval[1]:g}]" if interval else "")
    suffix = f"_cfg{scale:g}" + (f"_{interval[0]:g}-{interval[1]:g}" if interval else "")
    if path:
        name = os.path.splitext(os.path.basename(path))[0]
        text += f", autoguidance {w:g} by {path}"
        suffix += f"_ag{w:g}-{name}"
    if internal != 1:
        text, suffix = text + f", internal guidance {internal:g}", suffix + f"_ig{internal:g}"
    return text, suffix

# metrics.jsonl's fields of a guidance setting, by which `report` draws FID.
def guidance_record(scale, interval, guide, internal=1.0, guide_step=None, channels="all"):
    return {"cfg_scale": scale, "guidance_interval": interval, "guidance_channels": channels,
            "guide": guide[0], "guide_step": guide_step, "guide_scale": guide[1],
            "internal_scale": internal}

# The run's kept EMA (RUN/ema/) before `step` nearest half of it, the guide that guided best on
# CIFAR-10 (README, Guidance); None where none is kept.
def kept_guide(run_dir, step):
    folder = os.path.join(run_dir, "ema")
    kept = sorted(int(name[5:12]) for name in (os.listdir(folder) if os.path.isdir(folder) else [])
                  if re.fullmatch(r"step_\d{7}\.safetensors", name) and int(name[5:12]) < step)
    nearest = min(kept, key=lambda k: abs(k - step / 2), default=None)
    return nearest and os.path.join(folder, f"step_{nearest:07d}.safetensors")

# FID_SWEEP's settings that the model takes, as (scale, interval, (guide, weight), internal): CFG
# where it has a null label, autoguidance where `guide` (a kept EMA's path) is.
def swept_settings(cfg, guide):
    guided = bool(cfg.num_classes and cfg.class_dropout_prob)
    return [(scale, interval, (guide, w) if w != 1 else (None, 1.0), 1.0)
            for scale, interval, w in FID_SWEEP if (scale == 1 or guided) and (w == 1 or guide)]

# The noise levels at which the validation loss is measured: the centres of the LOSS_BINS ranges.
VAL_TIMES = (0.125, 0.375, 0.625, 0.875)

def validation_losses(model, objective, x0, y, key, n=None):
    """Losses (len(VAL_TIMES), n) of the first n held-out x0, noise from `key` for those n alone:
    comparable figures."""
    n = len(x0) if n is None else n
    pad = [(0, len(x0) - n)] + [(0, 0)] * (x0.ndim - 1)
    losses = []
    for i, frac in enumerate(VAL_TIMES):
        noise = jax.random.normal(jax.random.fold_in(key, i), (n, *x0.shape[1:]), x0.dtype)
        t = objective.time_at(jnp.full(len(x0), frac))
        losses.append(objective.losses_at(lambda x, t: model(x, t, y), x0, t,
                                          jnp.pad(noise, pad))["loss"][:n])
    return jnp.stack(losses)

def reference_on_every_host(paths):
    """(path, found): the first of `paths` that any process has, which all must have; else the
    last."""
    if not paths:
        return None, False
    have = np.array([[os.path.isfile(p) for p in paths]], np.int32)  # (processes, len(paths))
    if jax.process_count() > 1:
        have = multihost_utils.process_allgather(have[0])
    for path, hosts in zip(paths, have.T):
        if hosts.any() and not hosts.all():
            raise InputError(f"process {np.argmin(hosts)} has no {path}, the FID reference that "
                             f"process {np.argmax(hosts)} has: copy it to that path on process "
                             f"{np.argmin(hosts)}'s host (FID runs on every host), or train "
                             f"without FID (--final-fid 0, no --fid-every)")
        if hosts.any():
            return path, True
    return paths[-1], False

class Evaluator:
    """A run's evaluations of its EMA weights: grids from fixed noise, the validation loss, FID."""

    def __init__(self, config, cfg, graphdef, objective, mesh, ds, held_out):
        scores = bool(config.fid_every or config.final_fid)
        fixed = (config.fid_cfg_scale, config.fid_guidance_interval, config.fid_guide,
                 config.fid_guide_scale)
        self.swept = scores and all(option is None for option in fixed)
        counts = [n for n in (config.final_fid, config.fid_every and config.fid_samples) if n]
        if self.swept and min(counts) < len(FID_SWEEP):
            raise InputError(f"FID samples below the {len(FID_SWEEP)} settings that choose its "
                             f"guidance: give --final-fid and --fid-samples {len(FID_SWEEP)} or "
                             f"more, or fix the guidance with --fid-cfg-scale")
        guide_scale = 1.0 if config.fid_guide_scale is None else config.fid_guide_scale
        # a kept EMA (RUN/ema/), or another model, that can guide this one
        self.load_guide = lambda path: load_guide(  # noqa: E731
            path, cfg, objective, ds.latent_scale, config.run_dir,
            compute_dtype(config.precision))
        with on_every_host():  # each host's own VAE weights, and guide
            vae = (load_decoder(config.vae, ds.input_shape[-1], vae_dtype(config.precision))
                   if ds.is_latent else None)
            guide = (self.load_guide(config.fid_guide)[0]
                     if scores and config.fid_guide and guide_scale != 1 else None)
        self.sampler = functools.partial(Sampler, graphdef, objective, mesh, vae=vae,
                                         latent_scale=ds.latent_scale, steps=config.sample_steps,
                                         method=objective.default_method)
        self.grid_sampler, self.fid_sampler = self.sampler(cfg_scale=config.cfg_scale), None
        if scores and not self.swept:  # the setting that the options fix
            scale = FID_CFG_SCALE if config.fid_cfg_scale is None else config.fid_cfg_scale
            self.fid_sampler = self.sampler(cfg_scale=scale, interval=config.fid_guidance_interval,
                                            guide=guide, guide_scale=guide_scale)
        self.cfg = cfg
        batch, n = NamedSharding(mesh, P("data")), device_multiple(16)
        # the grid's inputs, made once where the sampler takes them: an evaluation moves nothing
        self.grid = jax.jit(lambda: (
            jax.random.normal(jax.random.key(config.seed + 1), (n, *ds.input_shape)),
            jnp.asarray(spread_labels(n, ds.num_classes)), jax.random.key(config.seed + 2)),
            out_shardings=(batch, batch, NamedSharding(mesh, P())))()
        self.config, self.ds, refs = config, ds, [config.fid_ref] if config.fid_ref else []
        if not refs and config.dataset == "imagenet100":
            data_dir = config.data_dir or default_data_dir("imagenet100")
            # the adm reference batch (all five numbers) where prepare_imagenet100.py wrote one
            refs = [os.path.join(data_dir, name) for name in ("fid_ref.npz", "fid_stats.npz")]
        self.ref, self.has_ref = reference_on_every_host(refs if scores else [])
        if self.has_ref:  # what FID needs, each host's own, before training rather than after
            with on_every_host():
                self.inception = fid_module().load_inception(config.inception)
                self.reference = fid_module().load_reference(self.ref)
        # Held-out samples and their noise use seed 0, not the run's, so every evaluation compares;
        # repeats pad them to a multiple of the devices, and validation_losses leaves those out.
        k = len(held_out)
        if k:
            eps = np.random.default_rng(0).standard_normal((k, *ds.input_shape), dtype=np.float32)
            x, y = ds.inputs(held_out, np.zeros(k, bool), eps if ds.is_latent else None)
            padded = np.resize(np.arange(k), device_multiple(k))
            rows = np.array_split(padded, jax.process_count())[jax.process_index()]
            self.val = [jax.make_array_from_process_local_data(batch, a[rows]) for a in (x, y)]
            self.val_fn = jax.jit(lambda params, x, y: validation_losses(
                nnx.merge(graphdef, params), objective, x, y, jax.random.key(0), k).mean(axis=1))

    def __call__(self, params, step, log):
        """The grid (samples/, TensorBoard), validation losses and FID due after step `step`."""
        config = self.config
        if step % config.sample_every == 0 or step == config.steps:
            images = self.grid_sampler(params, *self.grid)
            if jax.process_index() == 0:
                path = os.path.join(config.run_dir, "samples", f"step_{step:07d}.png")
                log.board.image(step, save_grid(images, path))
        if config.val_images and (step % config.val_every == 0 or step == config.steps):
            losses = to_host(self.val_fn(params, *self.val))
            log.write({"step": step, "val_loss": float(losses.mean()),
                       "val_loss_t": {f"{t:g}": float(v) for t, v in zip(VAL_TIMES, losses)}})
        if config.fid_every and step % config.fid_every == 0:
            self.fid(params, step, config.fid_samples, log)

    def fid(self, params, step, n, log):
        """Print and log FID-N and the other scores of n samples, at the fixed or swept guidance,
        or why none."""
        if not self.has_ref:
            print(f"FID skipped: no reference statistics{f' at {self.ref}' if self.ref else ''}; "
                  f"pass --fid-ref (`python fid.py ref IMAGES ref.npz` makes one)")
            return
        config, describe = self.config, fid_module().describe
        score = lambda sampler, n, seed: sample_and_score(  # noqa: E731
            sampler, params, n, config.batch_size, self.ds.input_shape, self.ds.num_classes, seed,
            self.inception, self.reference)[2]
        sampler, chosen = self.fid_sampler, {}
        if self.swept:
            sampler, text = self.sweep(score, step, n, log)
            chosen = {"guidance": text}
        scores = score(sampler, n, config.seed)
        log.write({"step": step, **fid_record(scores), **chosen})
        print(f"step {step}: {describe(scores)}" + (f", at {chosen['guidance']}" if chosen else ""))

    # (sampler, its setting's text): the setting of swept_settings with the lowest FID on
    # n // len(settings) samples each (together at most n), from the same noise, apart from the
    # final FID's so that its figure is not chosen on its own samples.
    def sweep(self, score, step, n, log):
        path = kept_guide(self.config.run_dir, step)
        with on_every_host():
            guide, meta = self.load_guide(path) if path else (None, {})
        settings = swept_settings(self.cfg, path)
        samplers = [self.sampler(cfg_scale=scale, interval=interval, guide_scale=w,
                                 guide=guide if w != 1 else None)
                    for scale, interval, (_, w), _ in settings]
        if len(settings) == 1:  # nothing to choose
            return samplers[0], guidance_names(*settings[0])[0]
        m, fids = n // len(settings), []
        for setting, sampler in zip(settings, samplers):
            scores = score(sampler, m, self.config.seed + 2)
            log.write({"step": step, **guidance_record(*setting, meta.get("step") if setting[2][0]
                                                       else None), **fid_record(scores)})
            print(f"step {step}: {guidance_names(*setting)[0]}: {fid_module().describe(scores)}")
            fids.append(scores["fid"])
        best = int(np.argmin(np.nan_to_num(np.array(fids, float), nan=np.inf)))
        return samplers[best], (f"{guidance_names(*settings[best])[0]}, the best of "
                                f"{len(settings)} settings at {count_label(m)} samples each")

#################################################################################
#                                 19. Benchmark                                 #
#################################################################################

# Dense bfloat16 (T4, V100: float16; P100: float32, as it runs) peak FLOP/s of one JAX device,
# for model FLOPs utilisation (MFU): a GPU (a MIG slice 3g.20gb: 3 of an A100's 7 compute slices)
# or TPU chip, but a TPU v2 or v3 chip's two cores are two devices with half its peak each (v3: 123
# TFLOP/s a chip); a v4 or v5p chip's two are one ("megacore"); v5e and v6e have one. TPUs go by
# exact device_kind (v5e's is "TPU v5 lite", v5p's "TPU v5"), GPUs by the first part of theirs
# found ("H100"; Kaggle's "P100-PCIE" before the SXM2 P100's).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "3g.20gb": 312e12 * 3 / 7, "A100": 312e12,
              "L4": 121e12, "A10G": 125e12, "A40": 150e12, "V100": 125e12, "T4": 65e12,
              "P100-PCIE": 9.3e12, "P100": 10.6e12, "TPU v2": 45e12 / 2, "TPU v3": 123e12 / 2,
              "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5": 459e12,
              "TPU v5p": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12}

def peak_flops(device):
    """PEAK_FLOPS of one JAX device like `device`, or None where unknown (a CPU)."""
    if device.platform == "tpu":
        return PEAK_FLOPS.get(device.device_kind)
    return next((v for k, v in PEAK_FLOPS.items() if k in device.device_kind), None)

def dit_flops(cfg):
    """Forward FLOPs of one image, 2 per multiply-add."""
    T, D, p, M = (cfg.grid ** 2, cfg.hidden_size, cfg.patch_size,
                  int(cfg.hidden_size * cfg.mlp_ratio))
    # qkv, proj, mlp, attention scores and values, adaLN
    per_block = T * (3 * D * D + D * D + 2 * D * M) + 2 * T * T * D + 6 * D * D
    embed = (T * p * p * cfg.in_channels * D + 256 * D + D * D + 2 * D * D
             + T * D * p * p * cfg.out_channels)
    return 2 * (cfg.depth * per_block + embed)

# The hours of the recipes' folder and ImageNet-100 runs at `seconds` a step.
def hours_of(seconds):
    return ", ".join(f"{k // 1000}K steps {k * seconds / 3600:,.1f} h" for k in (100_000, 400_000))

def profiled(profile_dir, name):
    """A jax.profiler trace into profile_dir/name, one TensorBoard run; none without profile_dir."""
    return (jax.profiler.trace(os.path.join(profile_dir, name)) if profile_dir
            else contextlib.nullcontext())

def timed(step, n, profile_dir, name):
    """(the compiling call's seconds; seconds a call of the n after, traced as `name`)."""
    start = time.perf_counter()
    jax.block_until_ready(step())
    compile_s = time.perf_counter() - start
    with profiled(profile_dir, name):
        start = time.perf_counter()
        for _ in range(n):
            out = step()
        jax.block_until_ready(out)
        return compile_s, (time.perf_counter() - start) / n

def bench(config):
    """Speed with random weights: the training step (masked, with each term), the forward pass,
    FID-N end to end."""
    config = checked(config)
    if config.target:
        return bench_target(config)
    if config.grad_accum != 1:
        raise InputError("bench times the step of one batch; --grad-accum goes with --target")
    if config.profile:
        writable(config.profile, folder=True)
    config = start_devices(config, config.batch_size)
    mesh = make_mesh()
    check_batch_size(config.batch_size)
    latent_channels = VAEConfig().latent_channels
    if config.fid and config.channels != latent_channels:
        raise InputError(f"--fid decodes with the SD VAE, whose latents have {latent_channels} "
                         f"channels; use --channels {latent_channels}")
    cfg = model_config(config, config.image_size, config.channels, 1000)
    tx, _ = make_optimizer(1e-4)
    graphdef, state, shardings = init_state(cfg, tx, 0, mesh, config.fsdp,
                                            compute_dtype(config.precision), config.remat)
    objective, masking = make_objective(config.objective), deferred_masking(config, cfg)
    terms = auxiliary_terms(config, cfg)
    step_fn, masked_fn = (jit_train_step(graphdef, objective, tx, 0.9999, False, 0, mesh, shardings,
                                         m) for m in (None, masking))
    batch = NamedSharding(mesh, P("data"))
    n, shape = config.batch_size, (config.image_size, config.image_size, config.channels)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n, *shape)), batch)
    y = jax.device_put(jnp.arange(n) % 1000, batch)

    def stepping(step_fn):
        def train_step():
            nonlocal state
            state, metrics = step_fn(state, x, y)
            return metrics["loss"]
        return train_step

    device = jax.devices()[0]
    peak = peak_flops(device)
    memory = lambda: (device.memory_stats() or {}).get("peak_bytes_in_use")  # noqa: E731
    gib = lambda mem: f"{mem / 2**30:.2f} GiB" if mem else "n/a"  # noqa: E731
    # The masked step first: the peak memory is the largest since the start.
    if masking:
        masked_compile_s, masked_s = timed(stepping(masked_fn), config.steps, config.profile,
                                           "masked")
        masked_mem = memory()
    compile_s, seconds = timed(stepping(step_fn), config.steps, config.profile, "train")

    def speed(flops, seconds):  # flops of one call, seconds per call
        mfu = (f"{100 * flops / seconds / (peak * jax.device_count()):.1f}%" if peak
               else "n/a (unknown peak)")
        return (f"{1000 * seconds:.1f} ms/step | {n / seconds:.1f} images/s | "
                f"{flops / seconds / 1e12:.2f} TFLOP/s model | MFU {mfu}")

    print(f"DiT-{config.size}/{config.patch} "
          f"{config.image_size}x{config.image_size}x{config.channels}, "
          f"global batch {n}, {config.arch}, {config.precision}"
          f"{f', remat {config.remat}' if config.remat else ''}"
          f"{', fsdp' if config.fsdp else ''}, {jax.device_count()} x {device.device_kind}")
    # backward = twice the forward
    print(f"  train:   compile {compile_s:.1f} s | {speed(3 * dit_flops(cfg) * n, seconds)} | "
          f"peak memory {gib(memory())}")
    figures = {"ms_per_step": 1000 * seconds, "images_per_s": n / seconds}
    if masking:
        tokens = masking.kept(cfg.grid ** 2)
        print(f"  masked:  compile {masked_compile_s:.1f} s | {1000 * masked_s:.1f} ms/step | "
              f"{n / masked_s:.1f} images/s, {seconds / masked_s:.2f}x | the backbone on {tokens} "
              f"of {cfg.grid ** 2} tokens | peak memory {gib(masked_mem)}")
        figures |= {"masked_ms_per_step": 1000 * masked_s, "masked_images_per_s": n / masked_s}
    for term in terms:  # each alone, beside the step without
        term_fn = jit_train_step(graphdef, objective, tx, 0.9999, False, 0, mesh, shardings,
                                 terms=(term,))
        compile_s, term_s = timed(stepping(term_fn), config.steps, config.profile, term.name)
        print(f"  {term.name}: compile {compile_s:.1f} s | {1000 * term_s:.1f} ms/step | "
              f"{n / term_s:.1f} images/s, {term_s / seconds:.2f}x the step without it")
        figures[f"{term.name}_ms_per_step"] = 1000 * term_s
    print(f"  hours:   {hours_of(seconds)}"
          + (f" | masked: {hours_of(masked_s)}" if masking else ""))
    forward = jax.jit(lambda params, x, t, y: nnx.merge(graphdef, params)(x, t, y),
                      in_shardings=(None, batch, batch, batch))
    t = jax.device_put(jnp.linspace(0.0, 1000.0, n), batch)
    compile_s, forward_s = timed(lambda: forward(state["params"], x, t, y), config.steps,
                                 config.profile, "forward")
    print(f"  forward: compile {compile_s:.1f} s | {speed(dit_flops(cfg) * n, forward_s)}")
    figures["forward_images_per_s"] = n / forward_s
    if config.fid:
        figures["fid_seconds"] = fid_module().bench_fid(config, cfg, objective, graphdef,
                                                        state["params"], mesh, shape)
    return figures

# --- A run compiled for its target ---------------------------------------------
# `bench --target NAME` compiles a run's programs for a device that this machine lacks, with XLA's
# compiler for it (jax.experimental.topologies): libtpu's for a TPU slice, jax[cuda12]'s for an
# NVIDIA GPU that a GpuTargetConfigProto describes. Nothing runs: each program's memory a device is
# XLA's count, as a run's own check counts it (step_memory), against what a run may use there.

# TPU slices: libtpu's topology, the chips of one host, and on v4 two cores a device ("megacore").
TPU_TARGETS = {"v3-8": ("v3:2x2", (2, 2, 1)), "v3-16": ("v3:4x2", (2, 2, 1)),
               "v4-8": ("v4:2x2x1", (2, 2, 1), "megacore"), "v5e-1": ("v5e:1x1", (1, 1, 1)),
               "v5e-8": ("v5e:2x4", (2, 4, 1)), "v6e-1": ("v6e:1x1", (1, 1, 1)),
               "v6e-8": ("v6e:2x4", (2, 4, 1))}
# A TPU device's HBM as XLA's TPU compiler counts it: the "available HBM" of its refusal of a larger
# program (libtpu 0.0.42.1).
TPU_HBM = {"TPU v3": 15.48 * 2**30, "TPU v4": 30.75 * 2**30, "TPU v5 lite": 15.75 * 2**30,
           "TPU v6 lite": 31.25 * 2**30}
# NVIDIA GPUs, from XLA's descriptions of them (xla/backends/gpu/target_config/specs/*.txtpb), the
# vendor's figures where XLA has none (A40, T4, the 32 GB V100) and a MIG slice as its share of an
# A100 40 GB (3 of 7 compute slices, 4 of 8 memory slices): name, compute capability, SMs, FP32
# units and threads an SM, shared memory an SM and a block's opt-in, L2, GHz, memory, bytes/s.
GPU_TARGETS = {
    "h100": ("NVIDIA H100 80GB HBM3", 9.0, 132, 128, 2048, 233472, 232448, 52428800, 1.98,
             84942979072, 3352320000000),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", 8.0, 108, 64, 2048, 167936, 166912, 41943040, 1.41,
                  85100068864, 2039040000000),
    "a100-40gb": ("NVIDIA A100-SXM4-40GB", 8.0, 108, 64, 2048, 167936, 166912, 41943040, 1.41,
                  42331013120, 1555200000000),
    "a100-3g.20gb": ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 8.0, 42, 64, 2048, 167936, 166912,
                     20971520, 1.41, 42331013120 // 2, 1555200000000 // 2),
    "a40": ("NVIDIA A40", 8.6, 84, 128, 1536, 102400, 101376, 6291456, 1.74, 48305799168,
            695800000000),
    "v100-32gb": ("Tesla V100-SXM2-32GB", 7.0, 80, 64, 2048, 98304, 98304, 6291456, 1.53,
                  34089730048, 898048000000),
    "v100-16gb": ("Tesla V100-SXM2-16GB", 7.0, 80, 64, 2048, 98304, 98304, 6291456, 1.53,
                  16935682048, 898048000000),
    "t4": ("Tesla T4", 7.5, 40, 64, 1024, 65536, 65536, 4194304, 1.59, 15843721216, 320064000000),
    "p100": ("Tesla P100-SXM2-16GB", 6.0, 56, 64, 2048, 65536, 49152, 4194304, 1.4805,
             17066885120, 732160000000)}
# The share of the peak at which the hours are estimated: about what DiT-S/2's step reached on an
# H100 (24.2% MFU, Speed) and ViT-S/16 on a TPU v3-8 (25%, the course's hours).
ESTIMATE_MFU = 0.25

# XLA's GpuTargetConfigProto of a GPU, as text, with cuDNN 9.10.
def gpu_target_config(name, capability, sms, fpus, threads, shared, shared_optin, l2, ghz, memory,
                      bandwidth):
    major, minor = divmod(round(capability * 10), 10)
    extension = "ACCELERATED_FEATURES" if major == 9 else "NONE"  # Hopper's wgmma, as sm_90a
    return f"""gpu_device_info {{
      threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: {threads}
      core_count: {sms} fpus_per_core: {fpus} clock_rate_ghz: {ghz}
      shared_memory_per_block: 49152 shared_memory_per_core: {shared}
      shared_memory_per_block_optin: {shared_optin} l2_cache_size: {l2}
      device_memory_size: {memory} memory_bandwidth: {bandwidth}
      block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
      thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
      registers_per_core_limit: 65536 registers_per_block_limit: 65536
      cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {extension} }}
    }}
    platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 10 }}
    device_description_str: "{name}"
    """

# (the devices of a target slice or GPU, the bytes a run may use of each, how that is set).
def target_devices(name):
    import importlib.util
    from jax.experimental import topologies
    if name in TPU_TARGETS:
        if not importlib.util.find_spec("libtpu"):
            raise InputError(f"--target {name} compiles with XLA's TPU compiler: pip install "
                             f"\"jax[tpu]=={jax.__version__}\"")
        topology, host, *chip = TPU_TARGETS[name]
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling needs no TPU to hold
        devices = topologies.get_topology_desc(
            platform="tpu", topology_name=topology, chips_per_host_bounds=host,
            wrap=(False, False, False), **({"chip_config_name": chip[0]} if chip else {})).devices
        return devices, TPU_HBM[devices[0].device_kind], "XLA's count of a TPU's HBM"
    if not importlib.util.find_spec("jax_plugins.xla_cuda12"):
        raise InputError(f"--target {name} compiles with XLA's CUDA compiler: pip install "
                         f"\"jax[cuda12]=={jax.__version__}\"")
    gpu = GPU_TARGETS[name]
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
    limit = int(fraction * gpu[-2])  # what JAX takes of it: XLA's compiler fits the program to it
    config = gpu_target_config(*gpu[:-2], limit, gpu[-1])
    devices = topologies.get_topology_desc(platform="cuda", target_config=config,
                                           topology="1x1x1").devices
    source = ("XLA_PYTHON_CLIENT_MEM_FRACTION" if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ
              else "JAX's default")
    return devices, limit, f"{fraction:g} of {size_text(gpu[-2])}, {source}"

# A compiled program's FLOPs a device as XLA counts them; None where it counts none (GPUs) or where
# the program loops (a sampler's steps, micro-batches), whose body XLA counts once.
def xla_flops(compiled):
    flops = (compiled.cost_analysis() or {}).get("flops")
    return None if "while(" in compiled.as_text() else flops

# One program's memory a device against `limit`, and its FLOPs a device where XLA counts them.
def compiled_line(name, compile, limit):
    counted = program_memory(compile)
    if not counted or sum(counted) > limit:
        return (f"  {name}: does not fit a device's {size_text(limit)}"
                + (f" ({size_text(sum(counted))})" if counted else " (XLA's compiler refused it)")
                + "; try a smaller --batch-size")
    flops = xla_flops(compile())
    return (f"  {name}: {size_text(sum(counted))} a device, fits"
            + (f" | {flops:.3g} FLOP a device" if flops else ""))

# bench --target: each program of a run compiled for the target, a line each.
def bench_target(config):
    jax.config.update("jax_platforms", "cpu")  # this machine's devices: only to trace on
    devices, limit, how = target_devices(config.target)
    token = TARGET_DEVICES.set(devices)
    try:
        config = with_precision(config)
        mesh = make_mesh()
        check_batch_size(config.batch_size, config.grad_accum)
        cfg = model_config(config, config.image_size, config.channels, 1000)
        tx, _ = make_optimizer(1e-4)
        dtype = compute_dtype(config.precision)
        _, graphdef, abstract, shardings = state_maker(cfg, tx, 0, mesh, config.fsdp, dtype,
                                                       config.remat)
        objective = make_objective(config.objective)
        masking, terms = deferred_masking(config, cfg), auxiliary_terms(config, cfg)
        batch, n = NamedSharding(mesh, P("data")), config.batch_size
        shaped = lambda shape, dtype, sharding=batch: jax.ShapeDtypeStruct(  # noqa: E731
            shape, dtype, sharding=sharding)
        state = jax.tree.map(lambda a, s: shaped(a.shape, a.dtype, s), abstract, shardings)
        x = shaped((n, config.image_size, config.image_size, config.channels), jnp.float32)
        y = shaped((n,), jnp.int32)
        make_step = functools.partial(jit_train_step, graphdef, objective, tx, 0.9999, False, 0,
                                      mesh, shardings, masking, terms)
        compiled = functools.cache(lambda k: make_step(k).lower(state, x, y).compile())
        device = devices[0]
        print(f"DiT-{config.size}/{config.patch} {config.image_size}x{config.image_size}x"
              f"{config.channels}, global batch {n}, {config.arch}, {config.objective}, "
              f"{config.precision}, attention "
              f"{attention_implementation(dtype, cfg.hidden_size // cfg.num_heads)}"
              f"{f', remat {config.remat}' if config.remat else ''}"
              f"{', fsdp' if config.fsdp else ''}, compiled for {len(devices)} x "
              f"{device.device_kind} ({config.target}): a run may use {size_text(limit)} a device "
              f"({how})")
        need, refusal = step_memory(compiled, config, limit)
        if refusal:
            print(f"  train:   {refusal}")
        else:
            counted = xla_flops(compiled(config.grad_accum))
            flops = counted or 3 * dit_flops(cfg) * n / len(devices)
            source = "XLA's" if counted else "dit_flops'"
            seconds = flops / (peak_flops(device) * ESTIMATE_MFU)
            print(f"  train:   {size_text(need)} a device: fits | {flops:.3g} FLOP a device "
                  f"({source} count) | at "
                  f"{ESTIMATE_MFU:.0%} of {device.device_kind}'s peak (an estimate): "
                  f"{1000 * seconds:.0f} ms a step, {hours_of(seconds)}")
        sampler = Sampler(graphdef, objective, mesh, steps=objective.default_steps,
                          method=objective.default_method, cfg_scale=FID_CFG_SCALE)
        key = shaped((), jax.eval_shape(lambda: jax.random.key(0)).dtype, NamedSharding(mesh, P()))
        params = state["params"]
        print(compiled_line(f"sample:  {objective.default_method}, {objective.default_steps} "
                            f"steps, guidance {FID_CFG_SCALE}, batch {n}",
                            functools.cache(sampler.run.lower(params, None, x, y, key,
                                                              sampler.cfg_scale).compile),
                            limit))
        bench_target_images(config, mesh, shaped, x, limit)
    finally:
        TARGET_DEVICES.reset(token)

# bench --target's programs around the model, each with its own batch: the SD VAE's decoder of the
# sampling batch (latents), the FID's Inception at evaluate's batch, and prepare_imagenet100.py's
# encoder at its batch of one host (its devices only: every host encodes on its own).
def bench_target_images(config, mesh, shaped, x, limit):
    fid, vae_cfg = fid_module(), VAEConfig()

    def abstract(shapes, mesh=mesh):  # (graphdef, the state's shapes, replicated over mesh)
        graphdef, state = shapes
        replicated = NamedSharding(mesh, P())
        return graphdef, jax.tree.map(lambda a: shaped(a.shape, a.dtype, replicated), state)

    latent = config.channels == vae_cfg.latent_channels
    side = config.image_size * (vae_cfg.downsampling if latent else 1)
    if latent:
        vae = abstract(module_shapes(AutoencoderKL, vae_cfg, dtype=vae_dtype(config.precision)))
        finish = decoder(mesh, vae[0], vae_cfg.scaling_factor)
        print(compiled_line(f"decode:  SD VAE, {side}x{side} images, batch {len(x)} "
                            f"({min(DECODE_CHUNK, len(x) // mesh.size)} a device at a time)",
                            functools.cache(finish.lower(vae[1], x).compile), limit))
    graphdef, state = abstract(module_shapes(fid.InceptionV3))
    n = fid.DEVICE_BATCH * mesh.size  # evaluate's batch
    images = shaped((n, side, side, 3), jnp.uint8)
    forward = fid._inception_forward.lower(graphdef, fid.DEFAULT_PROTOCOL, state, images)
    print(compiled_line(f"FID:     Inception ({fid.DEFAULT_PROTOCOL}), batch {n}",
                        functools.cache(forward.compile), limit))
    if not latent:
        return
    try:
        import prepare_imagenet100 as prepare
    except ModuleNotFoundError as e:
        if e.name != "prepare_imagenet100":
            raise
        print("  encode:  prepare_imagenet100.py is not beside dit.py")
        return
    devices = [d for d in mesh.devices.flat if d.process_index == 0]  # one host's
    data = NamedSharding(jax.sharding.Mesh(np.array(devices), ("data",)), P("data"))
    n = prepare.DEVICE_BATCH * len(devices)
    encode = functools.partial(prepare.encode_with_flip,
                               precision=prepare.default_vae_precision(devices[0]))
    vae = abstract(module_shapes(AutoencoderKL, vae_cfg), data.mesh)  # float32
    program = prepare.sharded_program(vae[0], encode, data).lower(
        vae[1], shaped((n, side, side, 3), jnp.uint8, data))
    print(compiled_line(f"encode:  SD VAE, prepare_imagenet100.py's, {side}x{side} images with "
                        f"their flips, batch {n} of a host", functools.cache(program.compile),
                        limit))

#################################################################################
#                                  20. Reports                                  #
#################################################################################

# `python dit.py report RUN [RUN ...] --out DIR`: a figure and a table of what runs logged, nothing
# evaluated again. A run's hours are the sum of its logged seconds per step (metrics.jsonl has no
# clock), which leave out evaluations and checkpoints (MetricsLog.paused): the hours of training.

def run_of(path):
    """The run directory of a weight file (RUN/checkpoints/*.npz, RUN/ema.safetensors), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.basename(folder) == "checkpoints":
        folder = os.path.dirname(folder)
    return folder if os.path.isfile(os.path.join(folder, "run.json")) else None

def as_number(value):
    """A logged figure as a float; NaN where missing."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else math.nan

class RunRecords:
    """A run directory as a report reads it: run.json's settings, metrics.jsonl's records by
    kind."""

    def __init__(self, run_dir):
        self.dir = run_dir
        path = os.path.join(run_dir, "run.json")
        if not os.path.isfile(path):
            raise InputError(f"{run_dir} is not a run directory: it has no run.json, which train "
                             f"writes in its --run-dir")
        self.settings = run_settings(read_json(path, lambda obj: isinstance(obj, dict),
                                               "the settings of a run",
                                               "the run directory is damaged"))
        path = os.path.join(run_dir, "metrics.jsonl")
        records = sorted(read_metrics(path) if os.path.isfile(path) else [],
                         key=lambda r: r["step"])
        self.train = [r for r in records if "loss" in r]
        if not self.train:
            raise InputError(f"{run_dir} has no metrics yet: a run logs its first record after "
                             f"--log-every steps")
        self.val = [r for r in records if "val_loss" in r]
        self.unmasked = [r for r in records if r.get("unmasked")]  # where --unmask-at ended masking
        self.fid = [r for r in records if "fid" in r and "cfg_scale" not in r]
        self.sweep = [r for r in records if "fid" in r and "cfg_scale" in r]
        steps = [0] + [r["step"] for r in self.train]
        seconds = np.diff(steps) * self.values(self.train, "s_per_step")
        self.hours = steps, np.concatenate([[0.0], np.nancumsum(seconds) / 3600])

    @staticmethod
    def values(records, key, entry=None):
        """(N,) the figure `key` of each record (its `entry` where the figure is a dict)."""
        values = [r.get(key) for r in records]
        return np.array([as_number(v.get(entry) if isinstance(v, dict) else None) if entry
                         else as_number(v) for v in values])

    def x(self, records, axis):
        """(N,) the records' steps, or the hours of training at those steps (axis "hours")."""
        steps = np.array([r["step"] for r in records], float)
        return np.interp(steps, *self.hours) if axis == "hours" else steps

def setting_option(settings, key):
    """A run's setting as its option ("--arch dit+"), or "" where --arch implies it or it is
    absent."""
    value, name = settings.get(key), "--" + key.replace("_", "-")
    if key == "masking":
        return (f"--mask-ratio {as_number(value.get('mask_ratio')):g} --mixer-depth "
                f"{value.get('mixer_depth')}" if isinstance(value, dict) else "--mask-ratio 0")
    if key == "terms":  # each auxiliary term by its switch
        return " ".join("--internal-guidance" if term == "internal" else f"--{term}"
                        for term in (value if isinstance(value, dict) else {}))
    if key == "internal_block":
        return f"{name} {value}" if value else ""
    if key in ARCHS["dit"] and bool(value) == ARCHS.get(settings.get("arch"), {}).get(key):
        return ""
    if key in ("dataset_size", "num_classes") and isinstance(value, int):
        return f"{value:,} {'images' if key == 'dataset_size' else 'classes'}"
    if isinstance(value, bool) or key in ARCHS["dit"]:
        return name if value else "--no-" + name[2:]
    if isinstance(value, list):
        return " ".join([name, *(f"{as_number(v):g}" for v in value)])
    if value is None:
        return ""
    return f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"

def run_labels(runs):
    """Each run named by its options that differ, and its folder where not unique."""
    keys = list(dict.fromkeys(k for run in runs for k in run.settings))
    options = [{k: setting_option(run.settings, k) for k in keys} for run in runs]
    differ = [k for k in keys if len({o[k] for o in options}) > 1]
    labels = [" ".join(o[k] for k in differ if o[k]) for o in options]
    return [label if label and labels.count(label) == 1
            else f"{os.path.basename(os.path.normpath(run.dir))} {label}".rstrip()
            for run, label in zip(runs, labels)]

def smoothed(values, share=0.02):
    """(N,) the trailing mean over `share` of the values: a noisy figure's trend."""
    w = max(1, round(share * len(values)))
    total, i = np.concatenate([[0.0], np.cumsum(values)]), np.arange(1, len(values) + 1)
    return (total[i] - total[np.maximum(i - w, 0)]) / np.minimum(i, w)

def scored(record):
    """How a record's scores were measured: "10K samples, adm"."""
    return (f"{count_label(as_number(record.get('fid_samples')))} samples, "
            f"{record.get('fid_protocol')}")

# The panels of FID and fid.py's other scores (the keys of their records, the panel's name).
SCORE_PANELS = ((("fid",), "FID"), (("sfid",), "sFID"), (("inception_score",), "Inception Score"),
                (("precision", "recall"), "Precision and Recall"))

def report_panels(runs, axis):
    """curves.png's rows of panels: (title, x label, y label, lines, legend entries)."""
    xlabel = "hours of training" if axis == "hours" else "training steps"
    loss, val, speed = [], [], []
    # where --unmask-at ended masking, a marker on the trend (after every run's lines)
    ends, ended = {"loss": [], "images_per_s": []}, dict(marker="v", linestyle="none")
    for i, run in enumerate(runs):
        x = run.x(run.train, axis)
        for lines, key in ((loss, "loss"), (speed, "images_per_s")):  # as logged, and the trend
            y = run.values(run.train, key)
            finite = np.isfinite(y)
            trend = smoothed(y[finite])
            lines += [(i, x, y, dict(alpha=0.25, linewidth=0.7)),
                      (i, x[finite], trend, dict(linewidth=1.5))]
            if run.unmasked:
                at = run.x(run.unmasked, axis)
                ends[key].append((i, at, np.interp(at, x[finite], trend), ended))
        # a marker at each evaluation: they are few, and a run evaluated once draws no line
        val.append((i, run.x(run.val, axis), run.values(run.val, "val_loss"), dict(marker="o")))
    validated = any(run.val for run in runs)
    legend = [("every patch from here (--unmask-at)", ended)] if ends["loss"] else []
    training = [("training loss (faint: as logged)", xlabel, "loss", loss + ends["loss"], legend),
                ("training speed (faint: as logged)", xlabel, "images/s",
                 speed + ends["images_per_s"], legend)]
    if validated:
        training.insert(1, ("validation loss, mean of the noise levels", xlabel, "loss", val, []))
    # each auxiliary term that a run logged, weighted as it adds to the loss
    for name in dict.fromkeys(k for run in runs for r in run.train for k in r.get("aux", {})):
        training.append((f"auxiliary term: {name} (weighted)", xlabel, "term",
                         [(i, run.x(run.train, axis), run.values(run.train, "aux", name), {})
                          for i, run in enumerate(runs)], []))
    levels = [(f"validation loss at t = {t:g}", xlabel, "loss",
               [(i, run.x(run.val, axis), run.values(run.val, "val_loss_t", f"{t:g}"),
                 dict(marker="o")) for i, run in enumerate(runs)], [])
              for t in VAL_TIMES if validated]
    # FID and the other scores: during training, a marker per sample count and protocol; by the
    # guidance scale of each run's newest sweep (its FID's own, or `sample --fid`'s), a colour and
    # marker per guidance setting and sample count; precision and recall by line style; legends
    # where there are several.
    kinds = sorted({scored(r) for run in runs for r in run.fid})
    markers = {kind: dict(marker="os^vD<>"[j % 7]) for j, kind in enumerate(kinds)}
    trained = []  # [(run index, xs, records, line options)]
    # sweeps by CFG's scale and by autoguidance's weight: lines as trained's, legend entries
    swept = {"guidance scale": ([], []), "autoguidance weight w": ([], [])}
    for i, run in enumerate(runs):
        for kind in kinds:
            group = [r for r in run.fid if scored(r) == kind]
            trained += [(i, run.x(group, axis), group, markers[kind])] if group else []
        newest = [r for r in run.sweep if r["step"] == run.sweep[-1]["step"]]
        # A line per setting but the axis's: CFG's scale, or autoguidance's weight from 1 (the
        # model alone at that CFG scale) on; the newest record of each point.
        # (interval, guided channels, how scored, internal guidance[, ...]) -> {x: record}
        by_scale, by_weight = {}, {}
        for r in sorted(newest, key=lambda r: bool(r.get("guide"))):  # the unguided first
            setting = (str(r.get("guidance_interval")), r.get("guidance_channels"), scored(r),
                       as_number(r.get("internal_scale", 1)))
            scale, weight = as_number(r["cfg_scale"]), as_number(r.get("guide_scale", 1))
            if r.get("guide") and weight != 1:
                line = by_weight.setdefault((*setting, scale, r["guide"]), {})
                line[weight] = r
                if scale in by_scale.get(setting, {}):
                    line[1.0] = by_scale[setting][scale]
            else:
                by_scale.setdefault(setting, {})[scale] = r
        for name, lines in zip(swept, (by_scale, by_weight)):
            for j, ((interval, channels, kind, internal, *guided), points) in enumerate(
                    lines.items()):
                style, xs = dict(color=f"C{i % 10}", marker="os^vD<>"[j % 7]), sorted(points)
                swept[name][0].append((i, np.array(xs), [points[x] for x in xs], style))
                where = "" if interval == "None" else f", CFG in {interval}"
                which = "" if channels in (None, "all") else f", {channels} channels guided"
                which += "" if internal == 1 else f", internal guidance {internal:g}"
                by = (f", CFG {guided[0]:g}, guide {os.path.basename(guided[1])}" if guided
                      else "")
                swept[name][1].append(
                    (f"step {newest[0]['step']:,}, {kind}{by}{where}{which}", style))
    styles = {"precision": dict(linestyle="-"), "recall": dict(linestyle="--")}
    scores, sweeps = [], []
    values = lambda lines, keys: [  # noqa: E731
        (i, xs, RunRecords.values(group, key), {**style, **styles.get(key, {})})
        for i, xs, group, style in lines for key in keys]
    for keys, title in SCORE_PANELS:
        by_key = [(key, styles[key]) for key in keys] if len(keys) > 1 else []
        during = values(trained, keys)
        if any(np.isfinite(ys).any() for _, _, ys, _ in during):
            by_kind = [(kind, markers[kind]) for kind in kinds] if len(kinds) > 1 else []
            ylabel = title if len(kinds) > 1 else f"{title} ({kinds[0]})"
            scores.append((f"{title} during training", xlabel, ylabel, during, by_kind + by_key))
        for x, (lines, entries) in swept.items():
            if lines and title in ("FID", "Precision and Recall"):
                what = "guidance" if x == "guidance scale" else "autoguidance"
                sweeps.append((f"{title} by {what} (newest sweep)", x, title, values(lines, keys),
                               entries + by_key))
    return [row for row in (training, levels, scores, sweeps) if row]

def report_figure(runs, labels, axis):
    """curves.png's Figure: a panel per figure, a colour per run."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter
    panels = report_panels(runs, axis)
    cols = max(map(len, panels))
    # A Figure of its own, not pyplot's: no backend to choose, nothing kept once it is returned.
    fig = Figure(figsize=(4.2 * cols, 3.3 * len(panels) + 0.3 * len(runs)), layout="constrained")
    axes = fig.subplots(len(panels), cols, squeeze=False)
    for row, axes_row in zip(panels, axes):
        for ax, (title, xlabel, ylabel, lines, entries) in zip(axes_row, row):
            for i, xs, ys, style in lines:
                ax.plot(xs, ys, **{"color": f"C{i % 10}", "markersize": 4, **style})
            ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
            ax.title.set_fontsize("medium")
            if xlabel == "training steps":
                ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 400k, not 400000
            ax.grid(alpha=0.3)
            if entries:
                ax.legend(handles=[Line2D([], [], **{"color": "grey", **style}, label=label)
                                   for label, style in entries], fontsize="x-small")
        for ax in axes_row[len(row):]:
            ax.remove()
    fig.legend(handles=[Line2D([], [], color=f"C{i % 10}", label=label)
                        for i, label in enumerate(labels)], loc="outside upper center",
               ncols=1 if len(labels) > 3 or max(map(len, labels)) > 40 else len(labels))
    return fig

def run_parameters(run_dir):
    """The parameter count of a run's newest checkpoint, from its metadata alone, or None."""
    found = list_checkpoints(run_dir)
    if not found:
        return None
    meta, _ = read_checkpoint(found[-1], names=[])
    deepest = max(size["depth"] for size in DIT_SIZES.values())  # a run's model has a --size
    return count_params(model_of_metadata(found[-1], meta, deepest, jnp.float32)[0])

def report_table(runs, labels, out, curves):
    """report.md's text: curves.png if drawn, a row per run, each newest grid linked from `out`."""
    lines = ["| run | settings | parameters | steps | hours | images/s (median) | val loss, last "
             "| val loss, best | latest FID |", "|" + " --- |" * 9]
    grids = []
    for run, label in zip(runs, labels):
        count = run_parameters(run.dir)
        val, val_steps = run.values(run.val, "val_loss"), [r["step"] for r in run.val]
        known = np.isfinite(val)
        last = f"{val[known][-1]:.4f}" if known.any() else ""
        best = (f"{np.nanmin(val):.4f} at step {val_steps[int(np.nanargmin(val))]:,}"
                if known.any() else "")
        fid = run.fid[-1] if run.fid else None
        fid = (f"{as_number(fid['fid']):.2f} ({scored(fid)}, step {fid['step']:,}"
               f"{', ' + fid['guidance'] if fid.get('guidance') else ''})" if fid else "")
        speed = np.nanmedian(run.values(run.train, "images_per_s"))
        cells = [run.dir, f"`{label}`", f"{count:,}" if count else "", f"{run.train[-1]['step']:,}",
                 f"{run.hours[1][-1]:.2f}", f"{speed:.1f}", last, best, fid]
        lines.append("| " + " | ".join(cells) + " |")
        samples = os.path.join(run.dir, "samples")
        names = sorted(n for n in os.listdir(samples) if re.fullmatch(r"step_\d{7}\.png", n)
                       ) if os.path.isdir(samples) else []
        if names:  # the newest grid
            link = os.path.relpath(os.path.join(samples, names[-1]), out).replace(os.sep, "/")
            grids += [f"**{label}**, step {int(names[-1][5:12]):,}:", "",
                      f"![{label}, step {int(names[-1][5:12]):,}]({link})", ""]
    text = ["# Runs", "", *(["![curves](curves.png)", ""] if curves else []), *lines, ""]
    return "\n".join(text + (["## Samples", "", *grids] if grids else []))

@dataclasses.dataclass
class Report:
    """What `report` returns: its files and the Figure, which a notebook shows."""
    markdown: str
    curves: str
    figure: object = dataclasses.field(repr=False)

    def _repr_png_(self):
        with open(self.curves, "rb") as f:
            return f.read()

def report(run_dirs, out, axis="steps"):
    """report.md and curves.png in `out` for `run_dirs`, against steps or hours (`axis`); without
    matplotlib, report.md alone."""
    writable(out, folder=True)
    runs = [RunRecords(d) for d in run_dirs]
    labels = run_labels(runs)
    try:
        import matplotlib  # optional, as tensorboard is: Colab and Kaggle have it
    except ImportError:
        matplotlib = None
    markdown, curves = os.path.join(out, "report.md"), os.path.join(out, "curves.png")
    with open(markdown, "w", encoding="utf-8") as f:
        f.write(report_table(runs, labels, out, curves=matplotlib is not None))
    if matplotlib is None:
        raise InputError(f"wrote {markdown}; curves.png needs matplotlib: pip install matplotlib")
    fig = report_figure(runs, labels, axis)
    fig.savefig(curves, dpi=100)
    print(f"{len(runs)} run{'s' * (len(runs) > 1)} -> {curves}, {markdown}")
    return Report(markdown, curves, fig)

#################################################################################
#                       21. Configuration and command line                      #
#################################################################################

# --- One-line errors -----------------------------------------------------------

def one_line(e):
    """`error: <message>` of an InputError or an OSError (a missing file, a full disk)."""
    message = str(e)
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        message = f"{e.filename}: {e.strerror}"  # rather than "[Errno 2] ...: 'path'"
    # A message can quote another library's error text, which may span lines.
    return "error: " + " ".join(message.splitlines())

# The oldest releases this file runs on: flax 0.12.0 brought nnx.List and needs jax 0.7.1; optax
# 0.2.5 brought optax.tree. Checked at import, so that an older notebook image ends in one line.
MINIMUM_VERSIONS = {"jax": "0.7.1", "flax": "0.12.0", "optax": "0.2.5"}

def check_versions(installed):
    """InputError naming the packages of `installed` ({name: version}) older than they must be."""
    number = lambda v: tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", v).group().split("."))
    old = [name for name, v in installed.items() if number(v) < number(MINIMUM_VERSIONS[name])]
    if old:
        found = ", ".join(f"{name} {installed[name]}" for name in old)
        need = [f"{name}>={MINIMUM_VERSIONS[name]}" for name in old]
        extras = " (for jax on a TPU or GPU: jax[tpu] or jax[cuda12])" if "jax" in old else ""
        raise InputError(f"found {found}; this code needs {', '.join(need)}: pip install -U "
                         f"{' '.join(repr(n) for n in need)}{extras}, then restart Python")

InputError._render_traceback_ = lambda self: [one_line(self)]  # IPython's: one line, no traceback

try:  # at import, before anything a user calls
    check_versions({name: sys.modules[name].__version__ for name in MINIMUM_VERSIONS})
except InputError as e:
    if hasattr(sys.modules["__main__"], "__file__"):  # a script, not a notebook or a prompt
        raise SystemExit(one_line(e)) from None
    raise

def run_cli(main, argv=None):
    """`main(argv)`: a user's mistake exits in one line; a bug keeps its traceback."""
    try:
        return main(argv)
    except (InputError, OSError) as e:
        raise SystemExit(one_line(e)) from None

class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose errors raise InputError instead of printing usage and exiting."""

    def error(self, message):
        raise InputError(f"{message} (--help lists the options)")

@contextlib.contextmanager
def errors_named(option):
    """Within it, an InputError starts with `option` ("--patch 4")."""
    try:
        yield
    except InputError as e:
        raise InputError(f"{option}: {e}") from None

# --- Configuration -------------------------------------------------------------
# Each command's settings are one frozen dataclass, a field per option: its default, its --help
# text and how argparse reads it. The parser is built from the fields, so an option is written in
# one place. A notebook passes the dataclass itself: dit.train(dit.TrainConfig(size="S", ...)).

def _parsed(parse, expected, ok=lambda value: True):
    """An argparse type: `parse(text)` if it parses and `ok` accepts it, else an error."""
    def argument(text):
        with contextlib.suppress(ValueError):
            value = parse(text)
            if ok(value):
                return value
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return argument

# Sizes and counts, scales (NaN fails `> 0` too), and lists such as "1,1.5,2" -> [1.0, 1.5, 2.0]
positive_int = _parsed(int, "a whole number of at least 1", lambda n: n >= 1)
non_negative_int = _parsed(int, "a whole number of at least 0", lambda n: n >= 0)
positive_float = _parsed(float, "a number above 0", lambda x: x > 0)
float_list = _parsed(lambda text: list(map(float, text.split(","))), "comma-separated numbers")
int_list = _parsed(lambda text: list(map(int, text.split(","))), "comma-separated whole numbers")
# --unmask-at: a step, or a share of the run, "90%" -> 0.9
step_or_share = _parsed(lambda text: float(text[:-1]) / 100 if text.endswith("%") else int(text),
                        "a step (at least 0) or a share of the run between 0% and 100%, e.g. 90%",
                        lambda v: 0 < v < 1 if isinstance(v, float) else v >= 0)

def option(default=None, help=None, *, run=False, **words):
    """A configuration field: default, --help text, argparse's words; run=True if it defines a
    run."""
    return dataclasses.field(default=default, metadata=dict(help=help, run=run, **words))

def redefault(cls, name, default):
    """The option `name` of `cls` with another default."""
    return dataclasses.field(default=default, metadata=cls.__dataclass_fields__[name].metadata)

STEPS_DEFAULT = "(default: " + ", ".join(f"{name} {objective.default_steps}"
                                         for name, objective in OBJECTIVES.items()) + ")"
BOOL = argparse.BooleanOptionalAction  # --x and --no-x, None where neither is given

def arch_switch(what):
    """A DiT+ switch of ARCHS, which --arch sets unless its own option says otherwise."""
    return option(None, f"{what} (default: as --arch says), for ablations", action=BOOL, run=True)

@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """The model that train and bench build, its objective, and how it computes."""
    size: str | None = option(None, "model size, Table 1 of the paper (T and D: small sizes for "
                              "CPU demos)", choices=list(DIT_SIZES), run=True)
    patch: int | None = option(None, "patch size p: the model sees (H/p)^2 tokens", type=int,
                               choices=[2, 4, 8], run=True)
    arch: str = option("dit", "dit: the paper's; dit+: with the changes of the README's ablation",
                       choices=list(ARCHS), run=True)
    qk_norm: bool | None = arch_switch("RMSNorm on queries and keys")
    rms_norm: bool | None = arch_switch("RMSNorm instead of LayerNorm")
    swiglu: bool | None = arch_switch("a SwiGLU feed-forward layer")
    rope: bool | None = arch_switch("2-D rotary position embeddings")
    objective: str = option("rf", "rectified flow; DiT's DDPM with learned variance (the "
                            "paper's); or EDM (Karras et al. 2022)", choices=list(OBJECTIVES),
                            run=True)
    precision: str | None = option(None, "compute dtype; parameters and optimizer state stay fp32 "
                                   "(default: bf16 on TPUs and NVIDIA GPUs from Ampere on, fp16 on "
                                   "older GPUs, fp32 on CPUs)", choices=["bf16", "fp16", "fp32"])
    remat: str | None = option(None, "recompute activations in the backward pass: dots (without "
                               "a value) keeps the matrix products' outputs, full only each "
                               "block's input", nargs="?", const="dots",
                               choices=list(REMAT_POLICIES))
    fsdp: bool = option(False, "shard parameters and optimizer state", action="store_true")
    mask_ratio: float = option(0.0, "deferred masking (MicroDiT): train the blocks after the mixer "
                               "on a random 1 - R of each image's patches (0: every patch); "
                               "sampling sees every patch", type=float, metavar="R")
    mixer_depth: int = option(2, "with --mask-ratio: the first N blocks see every patch (default: "
                              "2)", type=non_negative_int, metavar="N")
    # The auxiliary terms of section 12, each on its own switch; blocks count from 1.
    dispersive: bool = option(False, "dispersive loss on a block's tokens", action="store_true")
    dispersive_block: int | None = option(None, "its block (default: the last)",
                                          type=positive_int, metavar="K")
    dispersive_weight: float = option(0.5, "its weight in the loss (default: 0.5, its official "
                                      "code's)", type=positive_float, metavar="W")
    dispersive_temperature: float = option(1.0, "TAU of its similarities exp(-||z_i - z_j||^2 / "
                                           "(n TAU)), z a sample's n numbers after the block: a "
                                           "lower TAU weighs the nearest pairs more (default: 1, "
                                           "its official code's)", type=positive_float,
                                           metavar="TAU")
    sra: bool = option(False, "self-representation alignment: a block aligned through a "
                       "projection head to a later block of the EMA weights", action="store_true")
    sra_blocks: tuple[int, int] | None = option(None, "its blocks (default: a third and two "
                                                "thirds of the depth, 4 8 on DiT-S)",
                                                type=positive_int, nargs=2,
                                                metavar=("STUDENT", "TEACHER"))
    sra_offset: float = option(0.2, "the teacher's noise level is lower by up to this (uniform "
                               "per sample)", type=positive_float, metavar="DT")
    sra_weight: float = option(0.5, "its weight in the loss (default: 0.5, its paper's)",
                               type=positive_float, metavar="W")
    internal_guidance: bool = option(False, "an output head after an intermediate block, trained "
                                     "with the model, for `sample --internal-scale`",
                                     action="store_true")
    internal_block: int | None = option(None, "its block (default: 8 of 28 scaled to the depth, 3 "
                                        "on DiT-S)", type=positive_int, metavar="K", run=True)
    internal_weight: float = option(0.5, "the weight of the internal head's loss in the loss "
                                    "(default: 0.5, its paper's)", type=positive_float,
                                    metavar="W")

@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightOptions:
    """The weights that train and sample read beside the model's, and their seed."""
    vae: str = option("ema", "VAE of latent models: ema, mse (downloaded when missing), or a local "
                      "diffusers folder or weight file")
    inception: str | None = option(None, "pytorch-fid Inception weights for FID (downloaded when "
                                   "missing)")
    seed: int = option(0, "seed of every random number", type=int, run=True)

@dataclasses.dataclass(frozen=True, kw_only=True)
class HostOptions:
    """A multi-host run's processes, where no launcher set them up."""
    coordinator: str | None = option(None, "address:port of process 0, for multi-host runs that "
                                     "no launcher (SLURM, Open MPI, TPU pod) set up")
    num_processes: int | None = option(None, "processes of a multi-host run", type=positive_int)
    process_id: int | None = option(None, "this process's index, from 0", type=non_negative_int)

@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(HostOptions, WeightOptions, ModelOptions):  # None: with_defaults fills it in
    """train a DiT (the default command)"""
    dataset: str = option("mnist", "what to train on; its recipe (below) gives the defaults",
                          choices=["mnist", "cifar10", "imagenet100", "folder"], run=True)
    data_dir: str | None = option(None, "where the dataset is (downloaded there when missing, for "
                                  "mnist and cifar10)")
    resolution: int | None = option(None, "centre-crop size for --dataset folder",
                                    type=positive_int, run=True)
    timestep_sampling: str = option("logit_normal", "distribution of rectified flow's training "
                                    "times", choices=["logit_normal", "uniform"], run=True)
    ln_loc: float = option(0.0, "mean of the logit-normal timesteps", type=float, run=True)
    ln_scale: float = option(1.0, "scale of the logit-normal timesteps", type=positive_float,
                             run=True)
    batch_size: int | None = option(None, "batch over all devices and hosts", type=positive_int,
                                    run=True)
    grad_accum: int = option(1, "take each step's batch in K micro-batches, one after another: the "
                             "same update in less memory (dispersive loss then compares the "
                             "samples of each micro-batch)", type=positive_int, metavar="K")
    steps: int | None = option(None, "training steps", type=positive_int)
    lr: float | None = option(None, "AdamW learning rate", type=float, run=True)
    betas: tuple[float, float] = option((0.9, 0.999), "AdamW's moment decays", type=float,
                                         nargs=2, metavar=("B1", "B2"), run=True)
    warmup: int = option(0, "linear LR warm-up steps", type=non_negative_int, run=True)
    grad_clip: float = option(0.0, "max global gradient norm (0: off)", type=float, run=True)
    ema_decay: float | None = option(None, "decay of the EMA of the weights", type=float, run=True)
    ema_warmup: bool | None = option(None, "let the EMA's decay grow as (1 + step) / (10 + step) "
                                     "up to --ema-decay, so that a short run's early samples come "
                                     "from trained weights", action=BOOL, run=True)
    run_dir: str | None = option(None, "checkpoints, metrics and samples; an existing run there "
                                 "is resumed (default: runs/<dataset>-DiT-<size>-<patch>)")
    resume: str | None = option(None, "continue from this checkpoint file; without a file, from "
                                "the newest in --run-dir, which must have one", nargs="?",
                                const="latest")
    log_every: int | None = option(None, "steps between records in metrics.jsonl",
                                   type=positive_int)
    ckpt_every: int | None = option(None, "steps between checkpoints", type=positive_int)
    keep: int = option(3, "checkpoints kept (the newest is what a run resumes from)",
                       type=positive_int)
    keep_ema: tuple[int, ...] | None = option(None, "steps whose EMA weights stay in RUN/ema/ as "
                                              "guides for autoguidance, comma-separated (default: "
                                              "--ckpt-every times 1, 2, 4, 8, ...)", type=int_list,
                                              metavar="STEPS")
    time_limit: int | None = option(None, "stop with a checkpoint after this long, e.g. 8h30m, 90m "
                                    "or 45s, before a notebook ends (as Ctrl-C, SIGTERM, SIGUSR1 "
                                    "and a SLURM job's end do); the same command continues",
                                    type=duration,
                                    metavar="DURATION",  # a TrainConfig's: seconds, or this text
                                    text=lambda t: f"{t}s" if isinstance(t, int) else t)
    unmask_at: int | float | None = option(
        None, "with --mask-ratio: train on every patch after this many steps, or after this share "
        "of --steps or of the time to --time-limit or a SLURM job's end, whichever comes first "
        "(a final phase; a resumed run may set or move it before it comes)", type=step_or_share,
        metavar="STEP|SHARE%",  # a TrainConfig's: a step, a share (0.9) or this text ("90%")
        text=lambda v: f"{v * 100:.15g}%" if isinstance(v, float) else v)
    sample_every: int | None = option(None, "steps between sample grids", type=positive_int)
    val_images: int = option(0, "samples held out of training for the validation loss (0: none), "
                             "the same in every run on a dataset", type=non_negative_int, run=True)
    val_every: int | None = option(None, "steps between validation losses (default: "
                                   "--sample-every)", type=positive_int)
    sample_steps: int | None = option(None, f"sampling steps of the grids and FID {STEPS_DEFAULT}",
                                      type=positive_int)
    cfg_scale: float = option(GRID_CFG_SCALE, "guidance scale of the sample grids", type=float)
    fid_every: int = option(0, "FID every N steps (0: never)", type=non_negative_int)
    fid_samples: int = option(5000, "samples for --fid-every", type=positive_int)
    final_fid: int | None = option(None, "samples of the final FID (0: none)",
                                   type=non_negative_int)
    fid_cfg_scale: float | None = option(None, f"guidance scale of FID samples (default: "
                                         f"{FID_CFG_SCALE:g} where another --fid-* guidance "
                                         f"option is given, else each FID's guidance is the best "
                                         f"of a sweep on a tenth of its samples, README, Guidance)",
                                         type=float)
    fid_guidance_interval: tuple[float, float] | None = option(
        None, "guide FID samples only for timesteps in [T_LO, T_HI] (0..1000 scale)", type=float,
        nargs=2, metavar=("T_LO", "T_HI"))
    fid_guide: str | None = option(None, "autoguide FID samples by these weights (e.g. a guide "
                                   "that `sample --fid` chose from RUN/ema/)")
    fid_guide_scale: float | None = option(None, "autoguidance's weight for FID samples (default: "
                                           "1, none, where another --fid-* guidance option is "
                                           "given)", type=float)
    fid_ref: str | None = option(None, "reference batch or statistics .npz (imagenet100: "
                                 "<data-dir>/fid_ref.npz, else fid_stats.npz)")
    compile_cache: str | None = option(None, "JAX's persistent compilation cache, where a run that "
                                       "starts again finds its programs compiled (default: "
                                       "$JAX_COMPILATION_CACHE_DIR where set, else compile_cache "
                                       "beside --run-dir)", metavar="DIR",
                                       off="compile every program anew")
    profile: str | None = option(None, f"write a jax.profiler trace of steps "
                                 f"{PROFILE_STEPS.start + 1} to {PROFILE_STEPS.stop} of this "
                                 f"process to DIR (TensorBoard or Perfetto opens it)",
                                 metavar="DIR")

@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleConfig(HostOptions, WeightOptions):
    """sample from a checkpoint: a PNG grid, or --fid N samples and FID-N"""
    ckpt: str = option(None, "training checkpoint .npz, exported .safetensors or official .pt",
                       required=True)
    cfg_scale: tuple[float, ...] | None = option(
        None, f"classifier-free guidance scale (1: none; default {GRID_CFG_SCALE:g} for a grid, "
        f"{FID_CFG_SCALE:g} for --fid); with --fid, comma-separated scales are each sampled and "
        f"scored", type=float_list)
    steps: int | None = option(None, f"sampling steps {STEPS_DEFAULT}", type=positive_int)
    sampler: str | None = option(None, "; ".join(f"{name}: {' or '.join(o.METHODS)} (default "
                                                 f"{o.default_method})"
                                                 for name, o in OBJECTIVES.items()),
                                 choices=sorted({m for o in OBJECTIVES.values()
                                                 for m in o.METHODS}))
    guidance_channels: str = option("all", "guide all channels, or the first 3 as the official FID "
                                    "figures were computed", choices=["all", "3"])
    guidance_interval: tuple[tuple[float, float], ...] | None = option(
        None, "guide only for timesteps in [T_LO, T_HI] on the 0..1000 scale; with --fid, repeat "
        "it to sample and score each interval", type=float, nargs=2, metavar=("T_LO", "T_HI"),
        action="append")
    guide: tuple[str, ...] | None = option(None, "autoguidance: weights of a weaker network of the "
                                           "same data (an earlier EMA of the run, "
                                           "RUN/ema/step_N.safetensors, or a smaller model); with "
                                           "--fid, repeat it to sample and score each guide",
                                           action="append")
    guide_scale: tuple[float, ...] | None = option(None, "autoguidance's weight w: guide + w * "
                                                   "(model - guide) (1: the model alone); with "
                                                   "--fid, comma-separated weights are each "
                                                   "sampled and scored", type=float_list)
    internal_scale: tuple[float, ...] | None = option(
        None, "internal guidance's weight w: internal + w * (final - internal), of a model trained "
        "with --internal-guidance (1: the final layer alone); with --fid, comma-separated weights "
        "are each sampled and scored", type=float_list)
    guidance_sweep: bool = option(False, "with --fid: sample and score each setting of the sweep "
                                  "that chooses a run's FID guidance (README, Guidance), guided "
                                  "by the run's kept EMA nearest half the checkpoint's step",
                                  action="store_true")
    n: int = option(16, "images in the grid", type=positive_int)
    labels: tuple[int, ...] | None = option(None, "class labels of the grid (default: 0, 1, 2, "
                                            "...)", type=int, nargs="*")
    gif: str | None = option(None, "also write an animation of the sampling trajectory here")
    fid: int = option(0, "draw this many samples (labels spread evenly) as .npz",
                      type=non_negative_int)
    ref: str | None = option(None, "reference .npz for the scores (with --fid): `fid.py ref`'s, "
                             "OpenAI's reference batches, or FID statistics (`fid.py stats`)")
    batch_size: int = option(64, "global batch of --fid", type=positive_int)
    out: str | None = option(None, "output PNG (grid) or .npz (--fid)")
    precision: str | None = option(None, "compute dtype of the model and the VAE (default: as for "
                                   "training; fp32 gives the official numbers)",
                                   choices=["bf16", "fp16", "fp32"])

@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """write the EMA weights of a checkpoint as .safetensors"""
    ckpt: str = option(None, "training checkpoint .npz", required=True)
    out: str = option(None, "the .safetensors file to write", required=True)

@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig(ModelOptions):
    """speed with random weights: training and forward images/s, ms/step, memory, MFU; FID-N end
    to end"""
    size: str = redefault(ModelOptions, "size", "S")
    patch: int = redefault(ModelOptions, "patch", 2)
    image_size: int = option(32, "input height and width (latents: 32 for 256x256 images)",
                             type=positive_int)
    channels: int = option(4, "input channels (latents: 4)", type=positive_int)
    batch_size: int = option(256, "global batch of training, of the forward pass and of FID "
                             "sampling", type=positive_int)
    steps: int = option(10, "timed training steps and forward passes after the compiling one",
                        type=positive_int)
    fid: int = option(0, "also time FID-N end to end: sampling, SD VAE decoding, Inception",
                      type=non_negative_int, metavar="N")
    profile: str | None = option(None, "write jax.profiler traces of the timed steps to DIR/train, "
                                 "DIR/forward and DIR/fid (TensorBoard or Perfetto opens them)",
                                 metavar="DIR")
    grad_accum: int = option(1, "with --target: the step's batch in K micro-batches",
                             type=positive_int, metavar="K")
    target: str | None = option(None, "compile each program for this TPU slice or GPU, which the "
                                "machine need not have, and print its memory a device and FLOPs; "
                                "nothing runs", choices=[*TPU_TARGETS, *GPU_TARGETS])

@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """runs side by side: their curves in curves.png, a table and their newest grids in report.md"""
    runs: tuple[str, ...] = option(None, "run directories (train's --run-dir)", nargs="+",
                                   metavar="RUN", positional=True)
    out: str = option(None, "the folder to write curves.png and report.md in", required=True)
    x: str = option("steps", "the curves' axis: training steps, or hours of training (the logged "
                    "seconds of the steps; evaluations and checkpoints left out)",
                    choices=["steps", "hours"])

@dataclasses.dataclass(frozen=True, kw_only=True)
class FetchConfig:
    """download what runs read, beforehand"""
    vae: tuple[str, ...] = option(("ema",), "the released SD VAEs (default: ema, which latent "
                                  "runs and prepare_imagenet100.py read; --vae alone: none)",
                                  choices=["ema", "mse"], nargs="*")
    inception: bool = option(True, "pytorch-fid's Inception weights, for FID (default: on)",
                             action=BOOL)
    datasets: tuple[str, ...] = option(("mnist",), "the datasets (default: mnist, the default "
                                       "run's; cifar10 is 170 MB)", choices=["mnist", "cifar10"],
                                       nargs="*")

# The settings that define a run: resuming with different ones would silently train something else.
RUN_DEFINING = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["run"])

def run_settings(record):
    """run.json's entries that define its run: RUN_DEFINING's, and what no option gives."""
    return {k: v for k, v in record.items()
            if k in RUN_DEFINING or k not in TrainConfig.__dataclass_fields__}

def with_defaults(config):
    """`config` with what it leaves open filled in: the dataset's recipe, then what follows."""
    c = dataclasses.replace(config, **{k: v for k, v in RECIPES[config.dataset].items()
                                       if getattr(config, k) is None})
    run_dir = c.run_dir or os.path.join("runs", f"{c.dataset}-DiT-{c.size}-{c.patch}")
    cache = jax.config.jax_compilation_cache_dir or os.path.join(os.path.dirname(run_dir),
                                                                 "compile_cache")
    return dataclasses.replace(
        c, run_dir=run_dir, compile_cache=cache if c.compile_cache is None else c.compile_cache,
        val_every=c.val_every or c.sample_every,
        keep_ema=c.keep_ema or tuple(c.ckpt_every * 2 ** k
                                     for k in range((c.steps // c.ckpt_every).bit_length())),
        sample_steps=c.sample_steps or OBJECTIVES[c.objective].default_steps,
        **model_switches(c))

# --- Command line --------------------------------------------------------------

COMMANDS = {"train": TrainConfig, "sample": SampleConfig, "export": ExportConfig,
            "bench": BenchConfig, "report": ReportConfig, "fetch": FetchConfig}

def add_options(parser, config_class):
    """One argument of `parser` for each field of `config_class`, as the field's metadata says."""
    for f in dataclasses.fields(config_class):
        words = {k: v for k, v in f.metadata.items() if k not in ("run", "off", "text")}
        if words.pop("positional", False):
            parser.add_argument(f.name, **words)
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **words)
        if "off" in f.metadata:  # --no-compile-cache: the empty value
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name,
                                action="store_const", const="", help=f.metadata["off"])

def build_parser():
    """The command line's parser: a sub-command per configuration class, an option per field."""
    recipes = argparse.RawDescriptionHelpFormatter
    parser = OneLineParser(
        prog="dit.py", formatter_class=recipes, epilog=recipes_table(),
        description="Train (the default command), sample, export and benchmark DiT models, "
                    "report on runs, and fetch what they download; `dit.py COMMAND --help` lists "
                    "a command's options.")
    sub = parser.add_subparsers(dest="command")
    for name, config_class in COMMANDS.items():
        epilog = recipes_table() if name == "train" else None
        add_options(sub.add_parser(name, help=config_class.__doc__, formatter_class=recipes,
                                   epilog=epilog), config_class)
    return parser

def as_tuples(value):
    """A parsed value, lists as tuples: hashable."""
    return tuple(map(as_tuples, value)) if isinstance(value, list) else value

def parse(argv):
    """The configuration of a command line's words: TrainConfig where no command is named."""
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["train", *argv]
    args = vars(build_parser().parse_args(argv))
    return COMMANDS[args.pop("command")](**{k: as_tuples(v) for k, v in args.items()})

def command_line(config):
    """The words after `python dit.py` that give `config`, each setting off its default."""
    name = next(k for k, cls in COMMANDS.items() if type(config) is cls)
    words, last = [name], []
    for f in dataclasses.fields(config):
        value, flag = getattr(config, f.name), "--" + f.name.replace("_", "-")
        if f.metadata.get("positional"):
            last = [str(v) for v in value or ()]
        elif value == f.default:
            continue
        elif isinstance(value, bool):  # store_true's True, or --x / --no-x
            words.append(flag if value else "--no-" + flag[2:])
        elif f.metadata.get("action") == "append":
            for item in value:
                words += [flag, *map(str, item if f.metadata.get("nargs") else [item])]
        elif "nargs" in f.metadata and isinstance(value, (tuple, list)):
            words += [flag, *map(str, value)]
        elif isinstance(value, (tuple, list)):  # a comma-separated list
            words.append(f"{flag}={','.join(map(str, value))}")
        else:
            words.append(f"{flag}={f.metadata.get('text', str)(value)}")
    return words + last

def checked(config):
    """`config` as its command line parses, a wrong value refused alike."""
    return parse(command_line(config))

def start_devices(config, batch_size):
    """`config` with its precision, once the hosts are joined and a CPU split (split_cpu)."""
    if isinstance(config, HostOptions):
        setup_distributed(config)  # before anything else starts jax's backend
    split_cpu(batch_size)
    return with_precision(config)

def recipes_table():
    """RECIPES as the text that --help shows."""
    keys = list(RECIPES["mnist"])
    rows = [["dataset", *keys]] + [[name, *(str(r[k]) for k in keys)]
                                   for name, r in RECIPES.items()]
    widths = [max(map(len, column)) for column in zip(*rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "recipes (the defaults of each --dataset; any option overrides its value):\n  " + \
        "\n  ".join(lines)

def sample_command(config):
    """`python dit.py sample`: a grid, or FID-N samples and scores of each guidance setting from
    the same noise."""
    config = checked(config)
    config = start_devices(config, config.batch_size if config.fid else config.n)
    mesh = make_mesh()
    scales = config.cfg_scale or [FID_CFG_SCALE if config.fid else GRID_CFG_SCALE]
    if bool(config.guide) != bool(config.guide_scale):
        raise InputError("--guide and --guide-scale go together: the guide's weights, and the "
                         "weight w of guide + w * (model - guide), e.g. 2 (1: the model alone)")
    # autoguidance's settings, (guide, weight); at weight 1 the model alone, whatever the guide
    guides = list(dict.fromkeys((None, 1.0) if w == 1 else (guide, w)
                                for guide in config.guide or [None]
                                for w in config.guide_scale or [1.0]))
    names = [os.path.splitext(os.path.basename(g))[0] for g in dict.fromkeys(config.guide or [])]
    if len(set(names)) < len(names):  # the samples' files and report's lines go by the name
        twice = next(n for n in names if names.count(n) > 1)
        raise InputError(f"--guide: two guides are named {twice}, and their samples would share "
                         f"a file; copy one under another name")
    settings = list(itertools.product(scales, config.guidance_interval or [None], guides,
                                      config.internal_scale or [1.0]))
    if config.guidance_sweep and (config.cfg_scale or config.guidance_interval or config.guide
                                  or config.internal_scale or not config.fid):
        raise InputError("--guidance-sweep samples its own settings and scores them: give it with "
                         "--fid N, without --cfg-scale, --guidance-interval, --guide or "
                         "--internal-scale")
    if config.fid:
        check_batch_size(config.batch_size)
        if config.gif:
            raise InputError("--gif animates a grid; it does not go with --fid")
    elif len(settings) > 1:
        raise InputError("several --cfg-scale values, --guidance-interval ranges, guides or "
                         "--internal-scale weights are compared by their FID: give --fid N")
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    with on_every_host():  # each host reads its own copy of each
        fid = fid_module() if config.fid and config.ref else None
        reference = fid.load_reference(config.ref) if fid else None  # a bad file fails first
        model, objective, meta = load_model(config.ckpt, compute_dtype(config.precision))
        cfg, latent_scale = model.cfg, meta.get("latent_scale")
        vae = (load_decoder(config.vae, cfg.in_channels, vae_dtype(config.precision))
               if latent_scale else None)
        guide_models = {path: load_guide(path, cfg, objective, latent_scale, config.ckpt,
                                         compute_dtype(config.precision))
                        for path in dict.fromkeys(g for g, _ in guides if g)}
        if reference:
            say("loading the Inception network of the scores")
        inception = fid.load_inception(config.inception) if reference else None
    steps = config.steps or objective.default_steps
    method = config.sampler or objective.default_method
    say(f"{config.ckpt}: {count_params(model):,} parameters, input {cfg.input_size}x"
        f"{cfg.input_size}x{cfg.in_channels}, {objective.name}")
    if config.sampler and config.sampler not in objective.METHODS:
        raise InputError(f"--sampler {config.sampler} is not a sampler of this model's objective "
                         f"({objective.name}); use {' or '.join(sorted(objective.METHODS))}")
    if config.guidance_sweep:  # the run's kept EMA guides, where it is a run's and one is kept
        run_dir = run_of(config.ckpt) if isinstance(meta.get("step"), int) else None
        path = kept_guide(run_dir, meta["step"]) if run_dir else None
        with on_every_host():
            guide_models = {path: load_guide(path, cfg, objective, latent_scale, config.ckpt,
                                             compute_dtype(config.precision))} if path else {}
        settings, scales = swept_settings(cfg, path), []
    for scale in scales:
        with errors_named(f"--cfg-scale {scale:g}"):
            check_guidance(cfg, scale)
    for w in config.internal_scale or []:
        with errors_named(f"--internal-scale {w:g}"):
            check_guidance(cfg, 1.0, w)
    if config.labels and not all(0 <= label < cfg.num_classes for label in config.labels):
        raise InputError(f"--labels must lie in 0..{cfg.num_classes - 1}, the model's classes")
    shape = (cfg.input_size, cfg.input_size, cfg.in_channels)  # (H, W, C) of the model's input
    make_sampler = functools.partial(
        Sampler, nnx.graphdef(model), objective, mesh, steps=steps, method=method,
        guidance_channels=3 if config.guidance_channels == "3" else None, vae=vae,
        latent_scale=latent_scale, return_trajectory=bool(config.gif))
    # the weights on every device, once
    params = replicated(nnx.state(model, nnx.Param), mesh)

    def sampler_of(scale, interval, guide, internal):
        path, w = guide
        return make_sampler(cfg_scale=scale, interval=interval, internal_scale=internal,
                            guide=guide_models[path][0] if path else None, guide_scale=w)

    # Every file's folder made, or its path refused, before the sampling, which can take hours.
    root, ext = os.path.splitext(config.out or ("samples.npz" if config.fid else "samples.png"))
    outs = ([root + (guidance_names(*s)[1] if len(settings) > 1 else "") + ext for s in settings]
            if config.fid else [root + ext] + ([config.gif] if config.gif else []))
    with on_every_host():  # process 0 writes them
        if jax.process_index() == 0:
            for path in outs:
                writable(path)
    if not config.fid:
        sampler = sampler_of(*settings[0])
        n = device_multiple(config.n)
        labels = (np.resize(np.asarray(config.labels, np.int32), n) if config.labels
                  else spread_labels(n, cfg.num_classes))
        noise = jax.random.normal(jax.random.key(config.seed), (n, *shape))
        say(f"sampling {n} images ({method}, {steps} steps, {guidance_names(*settings[0])[0]})")
        out = sampler(params, noise, jnp.asarray(labels), jax.random.key(config.seed + 1))
        images, trajectory = out if config.gif else (out, None)
        if jax.process_index() != 0:
            return
        grid = save_grid(images[:config.n], outs[0])
        print(f"{config.n} samples -> {outs[0]} ({sampler.seconds['sample']:.1f} s)")
        if config.gif:
            grids = [make_grid(frame[:config.n]) for frame in trajectory]
            # hold the final grid for a while before the animation loops
            grids[0].save(config.gif, save_all=True, append_images=grids[1:] + [grids[-1]] * 20,
                          duration=60, loop=0)
            print(f"trajectory -> {config.gif}")
        return grid
    # the run that the weights are a step of, whose metrics the scores join
    run_dir = run_of(config.ckpt) if isinstance(meta.get("step"), int) else None
    if run_dir and reference and jax.process_index() == 0:
        try:  # a read-only copy of a run (a Kaggle version's output) is sampled all the same
            writable(os.path.join(run_dir, "metrics.jsonl"))
        except InputError as e:
            print(f"note: {e}; the scores are printed only")
            run_dir = None
    scores = {}
    for (scale, interval, (guide, w), internal), out in zip(settings, outs):
        setting = guidance_names(scale, interval, (guide, w), internal)[0]

        def save(images, labels):
            if jax.process_index() == 0:
                write_atomically(out, lambda f: np.savez(f, arr_0=images, labels=labels))
                print(f"{len(images)} samples ({setting}) -> {out}")
            if reference:
                say(f"scoring them against {config.ref}")
        say(f"sampling {config.fid} images ({method}, {steps} steps, {setting})")
        *_, result = sample_and_score(sampler_of(scale, interval, (guide, w), internal), params,
                                      config.fid, config.batch_size, shape, cfg.num_classes,
                                      config.seed, inception, reference, save)
        if result:
            print(f"{setting}: {fid.describe(result)}")
            scores[setting] = {k: v for k, v in result.items() if np.ndim(v) == 0}
            if run_dir and jax.process_index() == 0:
                record = {"step": meta["step"], **guidance_record(
                    scale, interval, (guide, w), internal,
                    guide_models[guide][1].get("step") if guide else None,
                    config.guidance_channels), "sampler": method, "sample_steps": steps,
                    **fid_record(result)}
                # Without the run's lock, so that a run's checkpoints are scored while it trains:
                # one line appended whole (a run resumed meanwhile drops it with its later records).
                with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(record) + "\n")
    if run_dir and reference:
        say(f"the scores joined {os.path.join(run_dir, 'metrics.jsonl')} (`dit.py report` draws "
            f"them)")
    return scores  # what a notebook shows: the scores of each setting, not the features

def export(config):
    """`python dit.py export`."""
    out = export_ema(config.ckpt, writable(config.out))
    print("EMA weights:", out)
    return out

def fetch(config):
    """`python dit.py fetch`."""
    config = checked(config)
    for source in config.vae:
        released_vae(source, fetching=True)
    if config.inception:
        fid_module().inception_file(fetching=True)
    files = {"mnist": _mnist_download, "cifar10": _cifar10_download}
    for name in config.datasets:
        files[name](default_data_dir(name), fetching=True)
    cache = os.path.abspath(default_cache_dir())
    if os.environ.get("DIT_CACHE"):
        print(f"On machines without network access, run with: export DIT_CACHE={cache}")
    else:
        print(f"Runs read the default cache, {cache}: where home folders are not shared, fetch "
              f"with DIT_CACHE set to a shared folder, and export it where runs run")

def main(argv=None):
    """The command line, also callable from a notebook: main(["--dataset", "mnist"])."""
    config = parse(list(sys.argv[1:] if argv is None else argv))
    run = {TrainConfig: train, SampleConfig: sample_command, ExportConfig: export,
           BenchConfig: bench, ReportConfig: lambda c: report(c.runs, c.out, c.x),
           FetchConfig: fetch}[type(config)]
    return run(config)

#################################################################################
#                                                                               #
#                     PART IV: APPENDIX, FILES FROM OUTSIDE                     #
#                                                                               #
#################################################################################
# The readers of files from outside: weights, checkpoints, arrays, MNIST's and CIFAR-10's files,
# JSON (PIL decodes images, in load_image; numpy maps prepared .npy files, in _load_imagenet100,
# once their headers match their sizes; fid.py reads torch's legacy format with the checks below).
# Part III calls forward into them, the book's one forward reference, so that every reader of
# outside bytes stands together. Each guarantees:
# - every claim of a file (a length, shape, offset or count) is checked against the bytes really
#   there before anything is allocated for it: a small file cannot ask for much memory;
# - no code from a file runs: safe_unpickle resolves only listed names; .npy is read without pickle;
# - a file that fails a check raises InputError naming the file and what to do: one line (run_cli).

#################################################################################
#                  22. Pickles and PyTorch files, without torch                 #
#################################################################################

class UnsafePickleError(InputError, pickle.UnpicklingError):
    """A pickle named a global that is not allowed."""

class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that reaches globals only through `allowed`: a pickle can call any function by
    name."""

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

def _read_at_most(f, n):
    """Up to n bytes of f in 1 MiB reads: a false count allocates only what is there."""
    pieces = []
    while n > 0 and (piece := f.read(min(n, 1 << 20))):
        pieces.append(piece)
        n -= len(piece)
    return b"".join(pieces)

def safe_unpickle(fileobj, allowed, persistent_load=None, encoding="ASCII"):
    """Unpickle the next pickle, globals only through `allowed` (else UnsafePickleError), storages
    through `persistent_load`; a damaged one raises pickle.UnpicklingError. Opcodes are checked
    before the unpickler allocates what they claim."""
    parts = []  # what genops reads, kept for the unpickler

    def keep(part):
        parts.append(part)
        return part
    recorder = types.SimpleNamespace(read=lambda n: keep(_read_at_most(fileobj, n)),
                                     readline=lambda: keep(fileobj.readline()))
    try:
        for seen, (opcode, arg, _) in enumerate(pickletools.genops(recorder)):
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg > seen:
                raise pickle.UnpicklingError(f"memo index {arg} after only {seen} opcodes: the "
                                             f"pickle is damaged or crafted")
    except ValueError as e:  # genops' word for truncated or unknown data
        raise pickle.UnpicklingError(f"damaged pickle ({e})") from None
    checked = io.BytesIO(b"".join(parts))
    return _RestrictedUnpickler(checked, allowed, persistent_load, encoding).load()

# Storage classes as torch names them in a pickle -> element type of their raw bytes.
# bfloat16 has no numpy type; it is read as uint16 and widened to float32 (exact) in _storage_array.
_TORCH_STORAGE_DTYPES = {"DoubleStorage": np.float64, "FloatStorage": np.float32,
                         "HalfStorage": np.float16, "BFloat16Storage": np.uint16,
                         "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
                         "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}

class _Record:
    """Base of the objects a pickle can reach; refuses BUILD, which could rewrite the shared storage
    types."""
    __slots__ = ()

    def __setstate__(self, state):
        raise UnsafePickleError(f"the file tried to modify a {type(self).__name__.strip('_')}; a "
                                f"torch.save file never does this, so it may be malicious. Nothing "
                                f"from the file was run.")

class _StorageType(_Record):
    """Stand-in for a `torch.*Storage` class: its element type."""
    __slots__ = ("name", "dtype")

    def __init__(self, name):
        self.name, self.dtype = name, np.dtype(_TORCH_STORAGE_DTYPES[name])

class _Storage(_Record):
    """A tensor storage; `data`, its 1-D array, once read."""
    __slots__ = ("storage_type", "numel", "data")

    def __init__(self, storage_type, numel):
        self.storage_type, self.numel, self.data = storage_type, numel, None

class _Tensor(_Record):
    """Where a tensor's elements are, as torch's _rebuild_tensor_v2 gives them."""
    __slots__ = ("storage", "offset", "size", "stride")

    def __init__(self, storage, offset, size, stride, *_):
        self.storage, self.offset, self.size, self.stride = (storage, offset, tuple(size),
                                                             tuple(stride))

# Everything a torch.save file of tensors, state dicts and official DiT training checkpoints
# ({"model", "ema", "opt", "args"}) names. argparse.Namespace becomes a SimpleNamespace: same
# attribute access, no argparse behaviour.
_TORCH_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _Tensor,
    ("torch._utils", "_rebuild_parameter"): lambda data, *_: data,  # a Parameter is its tensor
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): types.SimpleNamespace,
    **{("torch", name): _StorageType(name) for name in _TORCH_STORAGE_DTYPES},
}

def _storage_id(path, saved_id, file_size):
    """A persistent id ("storage", type, key, location, numel[, view]), checked: no storage larger
    than the file."""
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

def _storage_array(storage, raw, little_endian):
    """Checked raw bytes -> the storage's 1-D array (bfloat16 widened)."""
    dtype = storage.storage_type.dtype.newbyteorder("<" if little_endian else ">")
    data = np.frombuffer(raw, dtype, count=storage.numel).astype(dtype.newbyteorder("="))
    if storage.storage_type.name == "BFloat16Storage":  # bfloat16 is the top half of a float32
        data = (data.astype(np.uint32) << 16).view(np.float32)
    return data

def _materialize(path, obj, file_size):
    """Every _Tensor replaced by a numpy copy; all copies at most 8 times the file's size."""
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
            # A stride of 0 repeats elements, a few bytes asking for gigabytes; no state dict does.
            if math.prod(obj.size) > data.size:
                raise InputError(f"{path}: tensor of size {obj.size} has more elements than its "
                                 f"storage ({data.size}); repeated (expanded) tensors are not "
                                 f"supported, save them with .clone()")
            # The last element a view touches must lie in the storage, or as_strided reads anywhere.
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
            strides = [s * data.itemsize for s in obj.stride]
            return np.array(np.lib.stride_tricks.as_strided(data[obj.offset:], obj.size, strides))
        if isinstance(obj, dict):
            return {k: convert(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(convert(v) for v in obj)
        if isinstance(obj, types.SimpleNamespace):
            return types.SimpleNamespace(**convert(vars(obj)))
        return obj

    return convert(obj)

def _load_torch_zip(path, archive, file_size):
    """torch.save's format since 1.6: <top>/data.pkl and a file <top>/data/<key> per storage."""
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise InputError(f"{path}: a zip file but not a torch.save file (no <folder>/data.pkl)")
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
            storage.data = _storage_array(storage, read(info, f"storage {key!r}"), little_endian)
        return storages[key]

    raw = read(archive.getinfo(pickles[0]), pickles[0])
    return safe_unpickle(io.BytesIO(raw), _TORCH_ALLOWED, persistent_load)

def load_torch(path, legacy=None):
    """A torch.save file without torch: containers of numpy arrays (bfloat16 as float32); the legacy
    format only through `legacy(path, f, file_size)`, f past the magic number."""
    def not_torch(why):
        return InputError(f"{path}: not a PyTorch file ({why}): neither a zip archive nor a legacy "
                          f"torch.save pickle; pass the file that torch.save wrote")

    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        try:
            if not file_size:
                raise InputError(f"{path}: the file is empty; download or save it again")
            if zipfile.is_zipfile(f):
                with zipfile.ZipFile(f) as archive:
                    return _materialize(path, _load_torch_zip(path, archive, file_size), file_size)
            f.seek(0)
            if f.read(2) == b"PK":
                raise InputError(f"{path}: a damaged or truncated zip archive; download or save "
                                 f"it again")
            f.seek(0)
            try:
                magic = safe_unpickle(f, {})
            except UnsafePickleError:
                raise
            except (pickle.UnpicklingError, EOFError, ValueError, IndexError, struct.error) as e:
                raise not_torch(f"{type(e).__name__}: {e}") from None
            if magic != 0x1950A86A20F9469CFC6C:  # the first pickle of torch's legacy format
                raise not_torch(f"it starts with {reprlib.repr(magic)}")
            if legacy is None:
                raise InputError(f"{path}: torch's legacy format (torch.save before torch 1.6, or "
                                 f"_use_new_zipfile_serialization=False), which only fid.py reads; "
                                 f"load it with torch and torch.save it again")
            return _materialize(path, legacy(path, f, file_size), file_size)
        except UnsafePickleError as e:
            raise UnsafePickleError(f"{path}: {e}") from None
        except InputError:
            raise
        except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error, IndexError,
                TypeError, AttributeError, KeyError, ValueError, OverflowError, MemoryError,
                RecursionError, NotImplementedError, RuntimeError, OSError) as e:
            # Anything a damaged pickle or zip directory can raise: name the file, not the parser.
            raise InputError(f"{path}: damaged or truncated PyTorch file ({type(e).__name__}: "
                             f"{e}); download it again, or save it again with torch.save") from None

#################################################################################
#             23. Arrays: .npz, safetensors, IDX, CIFAR-10's pickles            #
#################################################################################

# Deflate cannot expand data more than 1032-fold (one 258-byte match per 2 bits).
_DEFLATE_MAX_RATIO = 1032

def read_npz(path, names=None):
    """{name: array} of an .npz: all, or those of `names` that it holds; headers checked against the
    bytes first."""
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
                                         f"more than the file holds; it is damaged, write it again")
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
    """One .npy entry of an .npz, its header checked first."""
    ratios = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: _DEFLATE_MAX_RATIO}
    ratio = ratios.get(info.compress_type)
    if ratio is None:
        raise InputError(f"{path}: {name} is compressed with zip method {info.compress_type}; "
                         f"numpy.savez and savez_compressed write stored or deflated entries, "
                         f"write it with them")
    if info.file_size > ratio * info.compress_size:
        raise InputError(f"{path}: {name} claims {info.file_size} bytes from {info.compress_size} "
                         f"stored; the file is damaged or crafted")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise InputError(f"{path}: {name} is in .npy format {version}, which is not read here; "
                             f"save it with numpy.savez")
        shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                           else np.lib.format.read_array_header_2_0(f))
        if dtype.hasobject:
            raise InputError(f"{path}: {name} holds Python objects, which only pickle can read "
                             f"(and a pickle can run code); refused. Save plain numeric arrays")
        nbytes, stored = math.prod(shape) * dtype.itemsize, info.file_size - f.tell()
        if any(n < 0 for n in shape) or nbytes != stored:
            raise InputError(f"{path}: {name} claims shape {shape} of {dtype} ({nbytes} bytes) but "
                             f"holds {stored} bytes; it is damaged or truncated, write it again")
        f.seek(0)  # read_array reads the header again, then the number of bytes checked here
        return np.lib.format.read_array(f, allow_pickle=False)

_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
                       "U8": np.uint8, "BOOL": np.bool_}

def read_safetensors(path):
    """(tensors, metadata) of a .safetensors file; BF16 as float32. Overlapping spans are
    refused."""
    def bad(problem):
        return InputError(f"{path} is not a readable safetensors file: {problem}. If it was "
                          f"downloaded, it may be incomplete; delete it and fetch it again.")
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise bad(f"only {len(blob)} bytes")
    n = int.from_bytes(blob[:8], "little")
    if n > len(blob) - 8:
        raise bad(f"the header claims {n} bytes but only {len(blob) - 8} follow the length field")
    try:
        header = json.loads(blob[8:8 + n])
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested without end
        raise bad(f"the header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad("__metadata__ is not an object of strings")
    data = memoryview(blob)[8 + n:]
    spans = []
    for name, info in header.items():
        try:
            kind, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            dtype = np.dtype(_SAFETENSORS_DTYPES[kind]).newbyteorder("<")
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"entry {name!r} is malformed or has an unsupported dtype ({e!r})") from None
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and type(begin) is int and type(end) is int and 0 <= begin <= end <= len(data)):
            raise bad(f"tensor {name!r} has shape {shape} and spans bytes {begin}..{end}, but the "
                      f"data has {len(data)} bytes")
        if end - begin != math.prod(shape) * dtype.itemsize:  # Python ints, which cannot overflow
            raise bad(f"tensor {name!r} has {end - begin} bytes, not what shape {shape} of {kind} "
                      f"needs")
        spans.append((begin, end, name, kind, dtype, shape))
    spans.sort()
    for (_, end, first, *_), (begin, _, second, *_) in zip(spans, spans[1:]):
        if begin < end:
            raise bad(f"tensors {first!r} and {second!r} share bytes {begin}..{end}")
    tensors = {}
    for begin, end, name, kind, dtype, shape in spans:
        arr = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
        if kind == "BF16":  # bfloat16 is the top half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = arr.astype(arr.dtype.newbyteorder("="))
    return tensors, metadata

def write_safetensors(f, tensors, metadata):
    """Write float32 `tensors` and string `metadata` to f as .safetensors."""
    header, offset = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        nbytes = 4 * int(np.prod(np.shape(t)))
        header[name] = {"dtype": "F32", "shape": list(np.shape(t)),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    f.write(len(raw).to_bytes(8, "little") + raw)
    for t in tensors.values():
        f.write(np.ascontiguousarray(t, "<f4").tobytes())

# IDX element type codes -> big-endian numpy types (http://yann.lecun.com/exdb/mnist/, at the end)
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

def read_idx(path: str) -> np.ndarray:
    """An IDX file's array, gzipped or not, its header checked against the file's size."""
    fix = "delete it and download it again"
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        gzipped = f.read(2) == b"\x1f\x8b"  # the gzip magic, whatever the file is called
        f.seek(0)
        stream = gzip.GzipFile(fileobj=f) if gzipped else f
        try:
            head = stream.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in _IDX_DTYPES:
                raise InputError(f"{path} is not an IDX file: it starts with bytes {head.hex()}, "
                                 f"an IDX file with 00 00, a type code and the number of "
                                 f"dimensions; {fix}")
            dims = stream.read(4 * head[3])
            if len(dims) < 4 * head[3]:
                raise InputError(f"{path}: the IDX header is cut short; {fix}")
            shape = struct.unpack(f">{head[3]}I", dims)
            dtype = np.dtype(_IDX_DTYPES[head[2]])
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > (_DEFLATE_MAX_RATIO if gzipped else 1) * size:
                raise InputError(f"{path}: its header announces shape {shape} ({nbytes} bytes), "
                                 f"more than the file can hold ({size} bytes); {fix}")
            data = _read_at_most(stream, nbytes + 1)  # one byte more tells a file that goes on
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(f"{path}: damaged gzip data ({e}); {fix}") from None
    if len(data) != nbytes:
        raise InputError(f"{path}: its header announces shape {shape} ({nbytes} bytes of data) but "
                         f"the file holds {'more' if len(data) > nbytes else len(data)}; it is "
                         f"truncated or damaged, {fix}")
    return np.frombuffer(data, dtype).reshape(shape).astype(dtype.newbyteorder("="))

# CIFAR-10's python release: a gzipped tar of pickles, each a dict of numpy arrays.
_CIFAR_MAX_BYTES = 1 << 28  # the official archive unpacks to 186 MB

_ARRAY_CLASS = object()  # what numpy.ndarray stands for in the pickles: only _empty_array takes it

def _empty_array(cls, shape, dtype):
    """numpy's _reconstruct for a pickled array: only an empty one, which the pickle fills from its
    bytes."""
    if cls is not _ARRAY_CLASS or shape != (0,):
        raise pickle.UnpicklingError(f"an array made as {reprlib.repr(shape)}, which numpy's "
                                     f"pickles never do")
    return np.empty(0).__reduce__()[0](np.ndarray, (0,), dtype)

# The official batches were pickled by Python 2 and numpy 1: an array is rebuilt from exactly these
# globals. Nothing else may be called while unpickling, so a tampered archive cannot run code.
_CIFAR_PICKLE_GLOBALS = {("numpy.core.multiarray", "_reconstruct"): _empty_array,
                         ("numpy", "ndarray"): _ARRAY_CLASS, ("numpy", "dtype"): np.dtype}

class _CappedGzip(gzip.GzipFile):
    """A gzip file that refuses to read past `limit` bytes: tarfile allocates what headers claim."""

    def __init__(self, path, limit):
        super().__init__(path, "rb")
        self.limit = limit

    def read(self, size=-1):
        if size < 0 or self.tell() + size > self.limit:
            raise InputError(f"{self.name} unpacks to more than {self.limit} bytes, more than "
                             f"CIFAR-10 holds; it is damaged, delete it and download it again")
        return super().read(size)

def _unpickle_cifar(f, where: str) -> dict:
    try:
        # encoding="bytes": Python 2's str objects inside (keys, pixel buffers) come back as bytes
        obj = safe_unpickle(f, _CIFAR_PICKLE_GLOBALS, encoding="bytes")
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{where}: {e}") from None
    # What the few callables allowed raise on arguments that are not numpy's
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError,
            IndexError) as e:
        raise InputError(f"{where} is not a readable CIFAR-10 batch ({type(e).__name__}: {e}); "
                         f"delete it and download CIFAR-10 again") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where} holds a {type(obj).__name__}, not the dict of a CIFAR-10 batch")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}

#################################################################################
#                             24. JSON and downloads                            #
#################################################################################

def read_json(path, valid, expected, fix):
    """The JSON in `path`, which `valid` must accept; else InputError with `fix`."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested without end
        raise InputError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not valid(obj):
        raise InputError(f"{path} is not {expected}; {fix}")
    return obj

def default_cache_dir():
    """Where downloaded weights and datasets go: $DIT_CACHE, or ~/.cache/dit-jax."""
    return os.environ.get("DIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dit-jax")

def downloaded(url, path, digest=None, algorithm="sha256", fetching=False):
    """`path`, from `url` when missing; `fetching`: reported, checked."""
    there = os.path.exists(path)
    if not there:
        download(url, path, digest, algorithm)
    elif fetching and digest is not None:
        with open(path, "rb") as f:
            found = hashlib.file_digest(f, algorithm).hexdigest()
        if found != digest:
            raise InputError(f"{path}: its {algorithm} is {found}, not the published {digest}; it "
                             f"is damaged or another file: delete it and fetch it again")
    if fetching:
        print(f"{path}: {'already there' if there else 'downloaded'}"
              f"{f', {algorithm} checked' if digest else ''}")
    return path

def download(url, path, digest=None, algorithm="sha256"):
    """Fetch url into path atomically, checked against `digest` if given."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    hasher = hashlib.new(algorithm)

    def fetch(f):
        with urllib.request.urlopen(url, timeout=60) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True,
                      desc=f"downloading {os.path.basename(path)}") as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    hasher.update(chunk)
                    bar.update(len(chunk))
        if total is not None and f.tell() != total:  # a connection that closed early
            raise http.client.IncompleteRead(b"", total - f.tell())
        if digest is not None and hasher.hexdigest() != digest:
            raise InputError(f"the download of {url} is corrupted: its {algorithm} is "
                             f"{hasher.hexdigest()}, the published one is {digest}. Try again, or "
                             f"put a good copy at {path}")

    try:
        write_atomically(path, fetch)
    except (OSError, http.client.HTTPException) as e:  # URLError and socket timeouts are OSErrors
        raise FileNotFoundError(f"could not download {url} ({e!r}). Without network access, "
                                f"download it elsewhere and put it at {path}") from None

# As a script; pasted into a notebook cell (no __file__ there), it only defines: call main([...]).
if __name__ == "__main__" and "__file__" in globals():
    run_cli(main)
