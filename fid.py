"""
FID, sFID, Inception Score, Precision and Recall with the FID InceptionV3 network, in JAX, as
OpenAI's evaluator or pytorch-fid computes them.

The network is the TF 2015 Inception graph that Heusel et al. (2017, "GANs Trained by a Two
Time-Scale Update Rule Converge to a Local Nash Equilibrium") used for FID, as ported to PyTorch by
pytorch-fid (github.com/mseitzer/pytorch-fid, inception.py). We read pytorch-fid's weight file
directly, without torch, through dit.py's restricted reader of PyTorch files and, for that file's
legacy format, load_torch here (dit.py holds the readers of untrusted files that both use, so
fid.py needs it beside, or pasted into the same notebook). Images
reach the network by one of two protocols (PROTOCOLS): `adm`, the way OpenAI's evaluator
(openai/guided-diffusion, evaluations/evaluator.py) feeds the TF graph, which gave every figure of
the DiT paper, or `pytorch-fid`'s.

    python fid.py ref FOLDER_OR_NPZ OUT.npz       # a reference batch (OpenAI's evaluator's layout)
    python fid.py ref mnist OUT.npz --images 1000 # ... of 1,000 of MNIST's own digits
    python fid.py stats FOLDER_OR_NPZ OUT.npz     # FID statistics (mu, sigma), pytorch-fid's layout
    python fid.py fid samples.npz ref.npz         # FID, sFID, IS, Precision, Recall of DiT samples
                                                    (sample_ddp.py's arr_0 layout)
    python fid.py is samples.npz                  # Inception Score
    python fid.py bench                           # images/s of the feature extractor

From Python: `evaluate(images, ref)` for uint8 (N, H, W, 3) arrays, `image_statistics` for
folders and .npz files, `InceptionFeatures` to stream batches as they are generated.
"""

import concurrent.futures
import functools
import hashlib
import math
import os
import reprlib
import struct
import sys
import tempfile
import time
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.special
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P
from PIL import Image

# dit.py holds what the two files share: the readers of untrusted files and dit.InputError. Run as a
# script or pasted into a notebook cell, each file registers itself, so that the other's import
# finds this very code rather than a second copy of it.
if __name__ == "__main__":
    sys.modules.setdefault("fid", sys.modules["__main__"])
try:
    import dit
except ModuleNotFoundError as e:
    if e.name != "dit":
        raise
    dit = sys.modules["__main__"]  # pasted before dit.py: its text will run in this same namespace

#################################################################################
#                      FID InceptionV3 (pytorch-fid's port)                     #
#################################################################################

def resize_matrix(in_size, out_size, half_pixel=True):
    """(out_size, in_size) matrix of bilinear resizing along one axis, without antialiasing.

    half_pixel=True is torch's `interpolate(align_corners=False)`, pytorch-fid's resize: output
    pixel i samples the input at src = (i + 0.5) * in/out - 0.5 (clamped below at 0).
    half_pixel=False is TensorFlow 1's `resize_bilinear` (align_corners=False), the ResizeBilinear
    node of the 2015 Inception graph that OpenAI's evaluator feeds: src = i * in/out, so the grid is
    anchored at the top-left pixel and the last rows repeat the edge. Either way the two neighbours
    of src mix linearly, and when shrinking the pixels between the sampled pairs are skipped.
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
DEVICE_BATCH = 128  # images a device feeds the Inception at a time, by default
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
    its seventh mixed block, which is Mixed_6d here (the graph numbers its blocks mixed, mixed_1,
    ..., mixed_10 for Mixed_5b ... Mixed_7c), flattened over the 17x17 grid as OpenAI's evaluator
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
#                Weights: pytorch-fid's file, read once and cached               #
#################################################################################

FID_WEIGHTS_URL = ("https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
                   "pt_inception-2015-12-05-6726825d.pth")
FID_WEIGHTS_NAME = os.path.basename(FID_WEIGHTS_URL)
FID_WEIGHTS_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"
_PASS_OFFICIAL = f"Pass {FID_WEIGHTS_NAME} from {FID_WEIGHTS_URL}"

def _load_torch_legacy(path, f, file_size):
    """torch's legacy format, the one of pytorch-fid's weights, for dit.load_torch, which has read
    its magic number: protocol and system-info pickles, the object pickle, the list of storage
    keys, then each storage as an int64 element count followed by its raw bytes. Every pickle goes
    through dit.py's restricted unpickler, every storage through its checks."""
    protocol, sys_info = dit.safe_unpickle(f, {}), dit.safe_unpickle(f, {})
    if protocol != 1001 or not isinstance(sys_info, dict):
        raise dit.InputError(f"{path}: unsupported legacy torch format (protocol "
                             f"{reprlib.repr(protocol)}); load it with torch and save it again")
    little_endian = sys_info.get("little_endian", True)
    storages = {}

    def persistent_load(saved_id):
        storage_type, key, numel = dit._storage_id(path, saved_id, file_size)
        return storages.setdefault(key, dit._Storage(storage_type, numel))

    obj = dit.safe_unpickle(f, dit._TORCH_ALLOWED, persistent_load)
    for key in dit.safe_unpickle(f, {}):  # the storage list, in the order of the data below
        if key not in storages:
            raise dit.InputError(f"{path}: the storage list names {reprlib.repr(key)}, which no "
                                 f"tensor uses; the file is damaged")
        storage = storages[key]
        header = f.read(8)
        if len(header) < 8:
            raise dit.InputError(f"{path}: truncated file (storage {key!r} is missing); download "
                                 f"or save it again")
        count = struct.unpack("<q" if little_endian else ">q", header)[0]
        if count != storage.numel:
            raise dit.InputError(f"{path}: storage {key!r} holds {count} elements where "
                                 f"{storage.numel} were expected; the file is damaged")
        nbytes = count * storage.storage_type.dtype.itemsize
        if nbytes > file_size - f.tell():  # checked before reading, so a lie cannot exhaust memory
            raise dit.InputError(f"{path}: truncated file (storage {key!r} needs {nbytes} more "
                                 f"bytes); download or save it again")
        storage.data = dit._storage_array(storage, f.read(nbytes), little_endian)
    return obj

def load_torch(path):
    """dit.load_torch, reading also torch's legacy format, in which pytorch-fid's weights are."""
    return dit.load_torch(path, _load_torch_legacy)

def _inception_with(state_dict, source):
    """An InceptionV3 holding pytorch-fid's state dict, read by dit.py's one loader of PyTorch
    weights (BatchNorm's training counter, num_batches_tracked, is not used at inference)."""
    if not (isinstance(state_dict, dict)
            and all(isinstance(v, np.ndarray) for v in state_dict.values())):
        raise dit.InputError(f"{source}: not a state dict of tensors. {_PASS_OFFICIAL}")
    return dit.load_torch_weights(dit.abstract_module(InceptionV3), state_dict, source,
                                  f"not pytorch-fid's FID Inception weights. {_PASS_OFFICIAL}",
                                  skip=r".*\.num_batches_tracked")

def inception_file(cache_dir=None, fetching=False):
    """pytorch-fid's weight file in the cache, downloaded when missing (`fetching`: as
    dit.downloaded's)."""
    return dit.downloaded(FID_WEIGHTS_URL, os.path.join(cache_dir or dit.default_cache_dir(),
                                                        FID_WEIGHTS_NAME),
                          FID_WEIGHTS_SHA256, fetching=fetching)

def load_inception(path=None, cache_dir=None):
    """The FID InceptionV3 with pytorch-fid's weights, read from `path` (its legacy-format .pth
    file).

    Without a path the file is looked for in the cache directory ($DIT_CACHE or ~/.cache/dit-jax)
    and downloaded there when missing. A file under the official name must have the official sha256;
    another file (e.g. the random-weight test fixture) is accepted with a warning that its numbers
    are not comparable with published ones. Its state dict is cached as an .npz named by the file's
    hash, which reads without the pickle's parsing.
    """
    cache_dir = cache_dir or dit.default_cache_dir()
    if path is None:
        path = inception_file(cache_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"FID Inception weights {path} not found; pass pytorch-fid's "
                                f"{FID_WEIGHTS_NAME} (from {FID_WEIGHTS_URL}) or leave the path "
                                f"out to download it")
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    if digest != FID_WEIGHTS_SHA256 and os.path.basename(path) == FID_WEIGHTS_NAME:
        raise dit.InputError(f"{path}: sha256 {digest} differs from the official "
                             f"{FID_WEIGHTS_SHA256}; the file is damaged or incomplete. Delete it "
                             f"and run again to download it afresh")
    cached = os.path.join(cache_dir, f"inception-{digest[:16]}-state-dict.npz")
    if os.path.exists(cached):
        inception = _inception_with(dit.read_npz(cached), path)
    else:
        state_dict = load_torch(path)
        inception = _inception_with(state_dict, path)  # checks the weights before they are cached
        try:  # write then rename, so that an interrupted run never leaves half a cache file
            os.makedirs(cache_dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".npz", delete=False) as f:
                np.savez(f, **state_dict)
            os.replace(f.name, cached)
        except OSError as e:
            warnings.warn(f"could not cache the Inception weights in {cache_dir} ({e}); they "
                          f"will be read from {path} again next time")
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
            raise dit.InputError(
                f"a covariance needs at least 2 images, got {self.count}; give more "
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
        raise dit.InputError(f"statistics do not match: mu {mu1.shape} vs {mu2.shape}, sigma "
                             f"{sigma1.shape} vs {sigma2.shape}; both must come from the same "
                             f"features (2048-d pool3 for FID)")
    diff = mu1 - mu2
    covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        warnings.warn(f"singular product sigma1 sigma2 (too few images?): adding {eps} to the "
                      f"diagonals")
        offset = np.eye(len(mu1)) * eps
        covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise dit.InputError(f"imaginary component {np.max(np.abs(covmean.imag))} in "
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
        raise dit.InputError(
            f"Inception Score with {splits} splits needs at least {splits} images, "
            f"got {len(logits)}; give more images")
    if not len(logits):
        raise dit.InputError("Inception Score of no images; give some")
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
        raise dit.InputError(f"Precision and Recall need more than {k} images in each set, got "
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
    stats = dit.read_npz(path, ["mu", "sigma"])
    if len(stats) < 2:
        raise dit.InputError(f"{path} has no `mu` and `sigma`, so it is not FID statistics; for an "
                             f".npz of images (`arr_0`) compute them with `python fid.py stats "
                             f"{path} OUT.npz`")
    mu, sigma = stats["mu"], stats["sigma"]
    if (mu.ndim != 1 or sigma.shape != (len(mu), len(mu))
            or mu.dtype.kind not in "fiu" or sigma.dtype.kind not in "fiu"):
        raise dit.InputError(
            f"{path}: mu {mu.dtype} {mu.shape} and sigma {sigma.dtype} {sigma.shape} "
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
    arrays = dit.read_npz(path, ["mu_s", "sigma_s", "pool", "protocol"])
    ref = {"protocol": file_protocol(arrays), "mu": mu, "sigma": sigma}
    if ref["protocol"] not in PROTOCOLS:
        raise dit.InputError(f"{path}: unknown protocol {ref['protocol']!r}; expected one of "
                             f"{', '.join(PROTOCOLS)}")
    if "mu_s" in arrays:
        mu_s, sigma_s = arrays["mu_s"], arrays.get("sigma_s")
        if (sigma_s is None or mu_s.shape != (SPATIAL_DIM,)
                or sigma_s.shape != (SPATIAL_DIM, SPATIAL_DIM)):
            raise dit.InputError(f"{path}: mu_s {mu_s.shape} and sigma_s "
                                 f"{None if sigma_s is None else sigma_s.shape} are not sFID "
                                 f"statistics ({SPATIAL_DIM},) and ({SPATIAL_DIM}, {SPATIAL_DIM}); "
                                 f"make the reference with `python fid.py ref`")
        ref["mu_s"], ref["sigma_s"] = mu_s.astype(np.float64), sigma_s.astype(np.float64)
    if "pool" in arrays:
        pool = arrays["pool"]
        if pool.ndim != 2 or pool.shape[1] != len(mu) or pool.dtype.kind != "f":
            raise dit.InputError(f"{path}: pool {pool.dtype} {pool.shape} is not (N, {len(mu)}) "
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
    """Stack a numpy array from every process: (P, *x.shape), from one device of each process to
    one of each (process_allgather of a host's array copies it to every device). 64-bit values
    travel as pairs of uint32, so they stay exact even though JAX (without x64) would narrow them
    to 32 bits."""
    x = np.ascontiguousarray(x)
    if jax.process_count() == 1:
        return x[None]
    firsts = [jax.local_devices(process_index=p)[0] for p in range(jax.process_count())]
    one_each = jax.sharding.NamedSharding(jax.sharding.Mesh(firsts, ("processes",)),
                                          P("processes"))
    local = (x.view(np.uint32) if x.dtype.itemsize == 8 else x)[None]  # (1, ...)
    gathered = multihost_utils.process_allgather(
        jax.make_array_from_process_local_data(one_each, local), tiled=True)
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

    def __init__(self, inception, batch_size=DEVICE_BATCH, progress=True,
                 protocol=DEFAULT_PROTOCOL):
        if protocol not in PROTOCOLS:
            raise dit.InputError(f"unknown protocol {protocol!r}; expected one of "
                                 f"{', '.join(PROTOCOLS)}")
        self.mesh = jax.make_mesh((jax.device_count(),), ("batch",))
        self.per_device = batch_size
        self.fc_bias = np.asarray(inception.fc.bias[...])
        graphdef, state = nnx.split(inception)
        # The weights replicated on every device, and kept so in the module: the next evaluation
        # with it (a guidance sweep's) finds them in place rather than sending them again.
        self.state = dit.replicated(state, self.mesh)
        nnx.update(inception, self.state)
        # (state, images) -> (pool, logits, spatial)
        self.forward = functools.partial(_inception_forward, graphdef, protocol)
        self.protocol = protocol
        self.stats, self.spatial_stats = FeatureStats(2048), FeatureStats(SPATIAL_DIM)
        self.pool, self.logits = [], []  # this process's (n, 2048) and (n, 1008) blocks
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
            raise dit.InputError(
                f"expected uint8 RGB images of shape (N, H, W, 3), got {images.dtype} "
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
            raise dit.InputError(
                f"images of different sizes {sorted(shapes)}: FID needs images of one "
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

class ImageFolder:
    """The image files under a folder (recursively, sorted) as a sequence: folder[i:j] -> uint8
    (n, H, W, 3).

    Files are decoded on a few threads (PIL releases the GIL); grayscale and RGBA become RGB as in
    pytorch-fid.
    """

    def __init__(self, root, count=None):
        loose, subfolders = dit.image_files(root)
        paths = sorted(loose + [path for found in subfolders.values() for path in found])
        if not paths:
            raise dit.InputError(
                f"no images ({', '.join(dit.IMAGE_EXTENSIONS)}) under {root}; give a "
                f"folder that holds some")
        # `count` of them, evenly spaced
        self.paths = [paths[i] for i in evenly_spaced(len(paths), count)] if count else paths
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
            raise dit.InputError(
                f"{path} is not a readable image ({type(e).__name__}: {e}); remove or "
                f"replace it") from None

    def _read_checked(self, path):
        image = self._read(path)
        if image.shape != self.shape:
            raise dit.InputError(f"{path} is {image.shape[1]}x{image.shape[0]} but {self.paths[0]} "
                                 f"is {self.shape[1]}x{self.shape[0]}: FID needs images of one "
                                 f"size; resize or crop them")
        return image

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        paths = self.paths[index]
        if not paths:
            return np.zeros((0, *self.shape), np.uint8)
        return np.stack(list(self.pool.map(self._read_checked, paths)))  # (n, H, W, 3)

# Datasets that a source may name: dit.py reads them (downloading them when missing), so that a
# reference of real digits needs no folder of images.
DATASETS = ("mnist", "cifar10")

def load_images(source, count=None, data_dir=None):
    """A folder of images, an .npz of uint8 images (`arr_0`, as DiT's sample_ddp.py writes) or a
    dataset of DATASETS (from data_dir, else dit.py's default place) -> a sequence of uint8
    (N, H, W, 3); `count` keeps that many, evenly spaced."""
    if source in DATASETS and not os.path.exists(source):
        images = dit.load_dataset(source, data_dir).x
        if images.shape[-1] == 1:  # MNIST: gray to RGB, as the sampler writes digits
            images = np.repeat(images, 3, axis=-1)
    elif os.path.isdir(source):
        return ImageFolder(source, count)
    elif not os.path.isfile(source):
        raise FileNotFoundError(f"{source}: no such folder or file (or dataset: "
                                f"{', '.join(DATASETS)})")
    elif not source.endswith(".npz"):
        raise dit.InputError(f"{source}: expected a folder of images or an .npz with the images in "
                             f"`arr_0`")
    else:
        images = dit.read_npz(source, ["arr_0"]).get("arr_0")
        if images is None:
            raise dit.InputError(
                f"{source} holds no images (`arr_0`, uint8 (N, H, W, 3)); give a folder "
                f"of images or an .npz of them")
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise dit.InputError(
                f"{source}: arr_0 is {images.dtype} {images.shape}, not uint8 RGB images "
                f"(N, H, W, 3); convert floats in [0, 1] with "
                f"(x * 255).round().clip(0, 255).astype(np.uint8)")
    return images[evenly_spaced(len(images), count)] if count else images

def image_statistics(images, inception, batch_size=DEVICE_BATCH, progress=True,
                     protocol=DEFAULT_PROTOCOL):
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
    with dit.tqdm(total=len(mine), unit="img", desc="Inception",
                  disable=not features.progress) as bar:
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
        raise dit.InputError(
            f"the reference was made with the {ref['protocol']} protocol, the samples "
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
    n = dit.count_label(result["count"])
    names = (("fid", "FID", ".3f"), ("sfid", "sFID", ".3f"), ("inception_score", "IS", ".2f"),
             ("precision", "Precision", ".4f"), ("recall", "Recall", ".4f"))
    figures = [f"{label}-{n} ({result['protocol']}) {result[key]:{spec}}"
               for key, label, spec in names if result[key] is not None]
    return ", ".join(figures) or f"no figures of {result['count']} images ({result['protocol']})"

def evaluate(images, ref=None, inception=None, batch_size=DEVICE_BATCH, progress=True,
             protocol=None):
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
        raise dit.InputError(f"the reference was made with the {ref['protocol']} protocol, not "
                             f"{protocol}; make one with `python fid.py ref IMAGES OUT.npz "
                             f"--protocol {protocol}`")
    protocol = ref["protocol"] if ref is not None else protocol or DEFAULT_PROTOCOL
    inception = inception or load_inception()
    if ref is not None and "images" in ref and "pool" not in ref:
        ref["pool"] = image_statistics(ref.pop("images"), inception, batch_size, progress,
                                       protocol)["pool"]
    features = InceptionFeatures(inception, batch_size, progress, protocol)
    with dit.tqdm(total=len(images), unit="img", desc="Inception",
              disable=not features.progress) as bar:
        features.update(images, bar)
    out = features.result()
    return {**scores(out, ref),
            **{key: out[key] for key in ("mu", "sigma", "mu_s", "sigma_s", "pool")}}

def _is_statistics_file(source):
    return (source.endswith(".npz") and os.path.isfile(source)
            and len(dit.read_npz(source, ["mu", "sigma"])) == 2)

def random_weights(cls, *args, **kwargs):
    """cls(*args, **kwargs) with random values drawn on the host rather than by its
    initialisers, for benchmarks, whose speed does not depend on the values: XLA took half a minute
    to compile the InceptionV3's or SD VAE's initialisers on a 2-core CPU. Kernels (2+ dims) are
    normal, variance 1 / fan-in (product of all dims but the last); vectors (biases, norm scales,
    BatchNorm statistics) are ones."""
    graphdef, state = dit.module_shapes(cls, *args, **kwargs)
    rng = np.random.default_rng(0)

    def draw(leaf):  # jax.ShapeDtypeStruct -> array
        if len(leaf.shape) < 2:
            return jnp.asarray(np.ones(leaf.shape, leaf.dtype))
        kernel = rng.standard_normal(leaf.shape, np.float32) / math.sqrt(math.prod(leaf.shape[:-1]))
        return jnp.asarray(kernel, leaf.dtype)

    return nnx.merge(graphdef, jax.tree.map(draw, state))

def benchmark(batch_sizes, image_size=256, steps=5):
    """Print images/s of the jit-compiled, sharded feature extractor (random weights: speed does not
    depend on them). Each step is timed from host uint8 images to features on the device."""
    inception = random_weights(InceptionV3)
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

def bench_fid(args, cfg, objective, graphdef, params, mesh, shape):
    """`dit.py bench --fid N`: FID-N timed as `sample --fid N` computes it (dit.sample_and_score),
    end to end: the objective's default sampler with guidance dit.FID_CFG_SCALE, the full-size SD
    VAE in dit.vae_dtype, the Inception statistics and features (evaluate, adm protocol), Precision
    and Recall against N reference features (the samples', reversed). A first pass compiles each
    phase at the timed shapes. Left out: the Frechet distances (FID, sFID), host-side and
    independent of N. Returns each phase's seconds and the total."""
    vae_cfg = dit.VAEConfig()
    vae = random_weights(dit.AutoencoderKL, vae_cfg, dtype=dit.vae_dtype(args.precision))
    inception = random_weights(InceptionV3)
    method, steps = objective.default_method, objective.default_steps
    sampler = dit.Sampler(graphdef, objective, mesh, steps=steps, method=method,
                          cfg_scale=dit.FID_CFG_SCALE, vae=vae,
                          latent_scale=vae_cfg.scaling_factor)
    b = args.batch_size
    start = time.perf_counter()
    images, _, _ = dit.sample_and_score(sampler, params, b, b, shape, cfg.num_classes, 0)
    # this process's share of N images, as sample_and_score feeds the Inception
    images = np.resize(images, (args.fid, *images.shape[1:]))
    pool = evaluate(images[jax.process_index()::jax.process_count()], inception=inception)["pool"]
    precision_recall(pool[::-1], pool)
    warm_up = time.perf_counter() - start
    sampler.seconds = dict.fromkeys(sampler.seconds, 0.0)
    with dit.profiled(args.profile, "fid"):
        start = time.perf_counter()
        images, _, out = dit.sample_and_score(sampler, params, args.fid, b, shape,
                                              cfg.num_classes, 0, inception)
        scored = time.perf_counter()
        precision_recall(out["pool"][::-1], out["pool"])
        end = time.perf_counter()
    seconds = {**sampler.seconds, "precision_recall": end - scored, "total": end - start}
    print(f"  FID-{dit.count_label(args.fid)} ({method}, {steps} steps, guidance "
          f"{dit.FID_CFG_SCALE}, {images.shape[1]}x{images.shape[2]} images): warm-up "
          f"{warm_up:.1f} s | " + " | ".join(f"{name} {s:.3f} s" for name, s in seconds.items())
          + f" | {args.fid / seconds['total']:.2f} images/s")
    return seconds

def _positive_ints(text):
    return [dit.positive_int(part) for part in text.split(",")]

def main(argv=None):
    parser = dit.OneLineParser(description="FID, sFID, Inception Score, Precision and Recall "
                                     "with pytorch-fid's InceptionV3, in JAX. A source is a folder "
                                     "of images, an .npz of uint8 images (arr_0), a dataset "
                                     "(mnist, cifar10) or, where statistics suffice, an .npz of "
                                     "statistics (mu, sigma) or a reference batch (`ref`, or "
                                     "OpenAI's).")
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
    reference.add_argument("--pr-images", type=dit.positive_int, default=REF_PR_IMAGES,
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
        command.add_argument("--batch-size", type=dit.positive_int, default=DEVICE_BATCH,
                             help="images per device per step")
        command.add_argument("--images", type=dit.positive_int, metavar="N",
                             help="use N of each source's images, evenly spaced (default: all)")
        command.add_argument("--data-dir", help=f"where a dataset source ({', '.join(DATASETS)}) "
                             f"is, or is downloaded to")
        command.add_argument("--protocol", choices=PROTOCOLS,
                             help=f"how images become features (default: a reference's own, "
                             f"else {DEFAULT_PROTOCOL}): adm is OpenAI's evaluator, which computed "
                             f"the DiT paper's figures; pytorch-fid is pytorch-fid's")
    bench = commands.add_parser("bench", help="images/s of the feature extractor")
    bench.add_argument("--batch-sizes", type=_positive_ints, default=None,
                       help="per-device batch sizes, comma-separated")
    bench.add_argument("--image-size", type=dit.positive_int, default=256)
    args = parser.parse_args(argv)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)

    if args.command == "bench":
        default = [4, 8, 16] if jax.default_backend() == "cpu" else [32, 64, 128, 256, 512]
        benchmark(args.batch_sizes or default, args.image_size)
        return
    inception = None

    def features(source, protocol):
        nonlocal inception
        # bad sources fail before the weights are fetched
        images = load_images(source, args.images, args.data_dir)
        if inception is None:
            say("loading the Inception network")
            inception = load_inception(args.weights)
        say(f"{source}: Inception features of {len(images)} images ({protocol})")
        out = image_statistics(images, inception, args.batch_size, protocol=protocol)
        say(f"{source}: {out['count']} images ({protocol})")
        return out

    protocol = args.protocol or DEFAULT_PROTOCOL
    if args.command in ("stats", "ref"):
        if _is_statistics_file(args.source):
            raise dit.InputError(
                f"{args.source} already holds statistics (mu, sigma); give images to "
                f"compute them from")
        with dit.on_every_host():  # process 0 writes it, once the features are computed
            if jax.process_index() == 0:
                dit.writable(args.out)
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
                raise dit.InputError(
                    f"{args.source2} was made with the {ref['protocol']} protocol, "
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
                raise dit.InputError(
                    f"{args.source1} was made with the {other['protocol']} protocol, "
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
        say(f"Inception Score-{dit.count_label(out['count'])} ({protocol}): "
            f"{result['inception_score']:.4f} +- {result['inception_score_std']:.4f}")

# As a script; pasted into a notebook cell (no __file__ there), it only defines its functions.
if __name__ == "__main__" and "__file__" in globals():
    dit.run_cli(main)
