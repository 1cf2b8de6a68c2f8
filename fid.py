"""
FID and Inception Score with the FID InceptionV3 network, in JAX, giving pytorch-fid's numbers.

The network is the TF 2015 Inception graph that Heusel et al. (2017, "GANs Trained by a Two
Time-Scale Update Rule Converge to a Local Nash Equilibrium") used for FID, as ported to PyTorch by
pytorch-fid (github.com/mseitzer/pytorch-fid, inception.py). We read pytorch-fid's weight file
directly, without torch, through dit.py's restricted reader of PyTorch files: dit.py holds every
reader of untrusted files, so fid.py needs it beside (or pasted into the same notebook).

    python fid.py stats FOLDER_OR_NPZ OUT.npz     # reference statistics (mu, sigma), pytorch-fid's
                                                    format
    python fid.py fid samples.npz ref_stats.npz   # FID-10K of DiT samples (sample_ddp.py's arr_0
                                                    layout)
    python fid.py is samples.npz                  # Inception Score
    python fid.py bench                           # images/s of the feature extractor

From Python: `evaluate(images, ref_stats)` for uint8 (N, H, W, 3) arrays, `image_statistics` for
folders and .npz files, `InceptionFeatures` to stream batches as they are generated.
"""

import concurrent.futures
import functools
import os
import sys
import struct
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.special
from flax import nnx, traverse_util
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from PIL import Image

# dit.py holds what the two files share: the readers of untrusted files and InputError. Run as a
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

def resize_matrix(in_size, out_size):
    """(out_size, in_size) matrix of torch's bilinear `interpolate(align_corners=False)` along one
    axis.

    Output pixel i samples the input at src = (i + 0.5) * in/out - 0.5 (clamped below at 0) and
    mixes its two neighbours linearly. There is no antialiasing: when shrinking, pixels between the
    sampled pairs are skipped, exactly as in pytorch-fid.
    """
    # Rounded as torch's CPU kernel rounds: a float32 scale, then a fused multiply-add rounded once
    # to float32.
    scale = np.float64(np.float32(in_size) / np.float32(out_size))
    src = np.maximum(((np.arange(out_size) + 0.5) * scale - 0.5).astype(np.float32), 0)
    lo = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = np.clip(src - lo, 0, 1).astype(np.float32)
    matrix = np.zeros((out_size, in_size), np.float32)
    rows = np.arange(out_size)
    np.add.at(matrix, (rows, lo), 1 - frac)  # add.at: lo == hi at the last input pixel
    np.add.at(matrix, (rows, hi), frac)
    return matrix


def resize_bilinear(x, height, width):
    """(B, H, W, C) -> (B, height, width, C) as torch's bilinear interpolate without antialiasing.

    Bilinear resizing is separable, so it is two small matrix products, with torch's interpolation
    weights (to float32 rounding) and fast on any device.
    """
    rows, cols = resize_matrix(x.shape[1], height), resize_matrix(x.shape[2], width)
    # HIGHEST keeps these products in true float32 where a GPU would otherwise use TF32.
    # (B, height, W, C)
    x = jnp.einsum("oh,bhwc->bowc", rows, x, precision=jax.lax.Precision.HIGHEST)
    # (B, height, width, C)
    return jnp.einsum("pw,bowc->bopc", cols, x, precision=jax.lax.Precision.HIGHEST)


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
    (B, 1008)).

    Same layers and names as pytorch-fid's `fid_inception_v3()`, so its weight file maps one to one.
    Inputs of any size are resized to 299x299 as pytorch-fid does; the 1008 logits (1000 ImageNet
    classes plus 8 unused, as in the TF graph) serve the Inception Score.
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

    def __call__(self, images):
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != jnp.uint8:
            raise ValueError(f"InceptionV3 expects uint8 RGB images of shape (B, H, W, 3), got "
                             f"{images.dtype} {tuple(images.shape)}; convert floats in [0, 1] with "
                             f"(x * 255).round().astype(uint8)")
        # Float32 products on every backend, as pytorch-fid's reference numbers were computed: XLA
        # otherwise multiplies float32 in TF32 on NVIDIA GPUs and in one bfloat16 pass on TPUs.
        with jax.default_matmul_precision("highest"):
            # pytorch-fid: uint8 / 255, bilinear resize to 299x299, then [0, 1] -> [-1, 1], in that
            # order.
            x = resize_bilinear(images.astype(jnp.float32) / 255, 299, 299)  # (B, 299, 299, 3)
            x = 2 * x - 1
            x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))  # (B, 147, 147, 64)
            x = max_pool_3x3(x, 2)  # (B, 73, 73, 64)
            x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))  # (B, 71, 71, 192)
            x = max_pool_3x3(x, 2)  # (B, 35, 35, 192)
            x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))  # (B, 35, 35, 288)
            x = self.Mixed_6a(x)  # (B, 17, 17, 768)
            x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(x))))  # (B, 17, 17, 768)
            x = self.Mixed_7a(x)  # (B, 8, 8, 1280)
            x = self.Mixed_7c(self.Mixed_7b(x))  # (B, 8, 8, 2048)
            pool = x.mean(axis=(1, 2))  # (B, 2048): pytorch-fid's "pool3" features
            return pool, self.fc(pool)  # (B, 2048), (B, 1008)


#################################################################################
#               Weights: pytorch-fid's file -> converted and cached              #
#################################################################################

FID_WEIGHTS_URL = ("https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
                   "pt_inception-2015-12-05-6726825d.pth")
FID_WEIGHTS_NAME = os.path.basename(FID_WEIGHTS_URL)
FID_WEIGHTS_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"


def _convert_torch_weights(state_dict, source):
    """pytorch-fid's state dict -> {"Mixed_5b/branch1x1/conv/kernel": array, ...} in the NNX model's
    layout."""
    if not (isinstance(state_dict, dict)
            and all(isinstance(v, np.ndarray) for v in state_dict.values())):
        raise dit.InputError(
            f"{source}: not pytorch-fid's FID Inception weights (not a state dict of "
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
        raise dit.InputError(f"{source}: not pytorch-fid's FID Inception weights "
                             f"({'; '.join(problems)}). Pass {FID_WEIGHTS_NAME} from "
                             f"{FID_WEIGHTS_URL}")
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
    cache_dir = cache_dir or dit.default_cache_dir()
    if path is None:
        path = os.path.join(cache_dir, FID_WEIGHTS_NAME)
        if not os.path.exists(path):
            dit.download(FID_WEIGHTS_URL, path, FID_WEIGHTS_SHA256)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"FID Inception weights {path} not found; pass pytorch-fid's "
                                f"{FID_WEIGHTS_NAME} (from {FID_WEIGHTS_URL}) or leave the path "
                                f"out to download it")
    digest = dit.file_digest(path)
    if digest != FID_WEIGHTS_SHA256 and os.path.basename(path) == FID_WEIGHTS_NAME:
        raise dit.InputError(f"{path}: sha256 {digest} differs from the official "
                             f"{FID_WEIGHTS_SHA256}; the file is damaged or incomplete. Delete it "
                             f"and run again to download it afresh")
    converted = os.path.join(cache_dir, f"inception-{digest[:16]}.npz")
    if os.path.exists(converted):
        inception = _build_inception(dit.read_npz(converted), path)
    else:
        params = _convert_torch_weights(dit.load_torch(path), path)
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


def inception_score(logits, splits=10):
    """(mean, std) over `splits` equal parts of exp(E_x KL(p(y|x) || p(y))) (Salimans et al. 2016).

    p(y|x) is the softmax of the 1008 logits; p(y) is the mean over each part. Pass the logits
    without the bias of the last layer (pool @ W), as the original TF code and OpenAI's evaluator
    compute them: InceptionFeatures.result()["score_logits"].
    """
    logits = np.asarray(logits, np.float64)
    if len(logits) < splits:
        raise dit.InputError(
            f"Inception Score with {splits} splits needs at least {splits} images, "
            f"got {len(logits)}; give more images")
    log_p = logits - scipy.special.logsumexp(logits, axis=1, keepdims=True)  # (N, 1008): log p(y|x)
    scores = []
    for part in np.array_split(log_p, splits):
        log_marginal = np.log(np.exp(part).mean(axis=0))  # (1008,): log p(y) over this part
        kl = (np.exp(part) * (part - log_marginal)).sum(axis=1)  # (n,)
        scores.append(np.exp(kl.mean()))
    return float(np.mean(scores)), float(np.std(scores))


def save_statistics(path, mu, sigma):
    """Write FID statistics as pytorch-fid does: an .npz with `mu` (D,) and `sigma` (D, D)."""
    np.savez(path, mu=np.asarray(mu, np.float64), sigma=np.asarray(sigma, np.float64))


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


@functools.partial(jax.jit, static_argnums=0)
def _inception_forward(graphdef, state, images):
    """Compiled once per (batch, image shape) and shared by every InceptionFeatures (e.g. repeated
    evaluations)."""
    return nnx.merge(graphdef, state)(images)


class InceptionFeatures:
    """Streams uint8 images through the InceptionV3: pool3 statistics in float64 and all logits.

    Each call to `update` runs jit-compiled batches sharded over every device (a 1-D mesh), the last
    batch padded and the padding dropped. Under `jax.distributed` every process passes its own
    images and calls `update` the same number of times (it is a collective); `result` combines all
    processes.
    """

    def __init__(self, inception, batch_size=128, progress=True):
        self.mesh = jax.make_mesh((jax.device_count(),), ("batch",))
        self.per_device = batch_size
        graphdef, state = nnx.split(inception)
        # weights replicated on every device
        self.state = jax.device_put(state, NamedSharding(self.mesh, P()))
        # (state, images) -> (pool, logits)
        self.forward = functools.partial(_inception_forward, graphdef)
        self.stats = FeatureStats(2048)
        self.logits = []  # this process's (n, 1008) blocks
        self.fc_bias = np.asarray(inception.fc.bias[...])
        self.image_shape = None
        self.progress = progress and jax.process_index() == 0

    def _to_host(self, outputs, valid):
        pool, logits = multihost_utils.global_array_to_host_local_array(outputs, self.mesh,
                                                                        P("batch"))
        self.stats.update(np.asarray(pool)[:valid])
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
        """{"mu", "sigma", "count", "logits", "score_logits"} over the images of all processes:
        "logits" are pytorch-fid's (the last layer's output), "score_logits" the same without its
        bias, for the Inception Score."""
        stats = FeatureStats(2048)
        gathered = _allgather(np.concatenate([[self.stats.count], self.stats.mean,
                                              self.stats.scatter.ravel()]))
        for row in gathered:  # (1 + D + D*D,) per process
            stats.merge(int(row[0]), row[1:2049], row[2049:].reshape(2048, 2048))
        logits = np.concatenate(self.logits) if self.logits else np.zeros((0, 1008), np.float32)
        if jax.process_count() > 1:  # pad to a common length to gather, then drop the padding
            counts = _allgather(np.array([len(logits)]))[:, 0]
            padded = np.zeros((counts.max(), 1008), np.float32)
            padded[:len(logits)] = logits
            logits = np.concatenate([rows[:n] for rows, n in zip(_allgather(padded), counts)])
        mu, sigma = stats.mu_sigma()
        return {"mu": mu, "sigma": sigma, "count": stats.count, "logits": logits,
                "score_logits": logits - self.fc_bias}


class ImageFolder:
    """The image files under a folder (recursively, sorted) as a sequence: folder[i:j] -> uint8
    (n, H, W, 3).

    Files are decoded on a few threads (PIL releases the GIL); grayscale and RGBA become RGB as in
    pytorch-fid.
    """

    def __init__(self, root):
        self.paths = sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files
                            if f.lower().endswith(dit.IMAGE_EXTENSIONS))
        if not self.paths:
            raise dit.InputError(
                f"no images ({', '.join(dit.IMAGE_EXTENSIONS)}) under {root}; give a "
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


def load_images(source):
    """A folder of images or an .npz of uint8 images (`arr_0`, as DiT's sample_ddp.py writes) -> a
    sequence."""
    if os.path.isdir(source):
        return ImageFolder(source)
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source}: no such folder or file")
    if not source.endswith(".npz"):
        raise dit.InputError(f"{source}: expected a folder of images or an .npz with the images in "
                             f"`arr_0`")
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
    return images


def image_statistics(images, inception, batch_size=128, progress=True):
    """{"mu", "sigma", "count", "logits", "score_logits"} of a sequence of uint8 images (an array or
    an ImageFolder).

    Under `jax.distributed` each process reads every process_count-th image, so together they cover
    it once.
    """
    rank, world = jax.process_index(), jax.process_count()
    mine = range(rank, len(images), world)
    features = InceptionFeatures(inception, batch_size, progress)
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

def evaluate(images, ref_stats=None, inception=None, batch_size=128, progress=True):
    """FID against reference statistics, Inception Score and the statistics of uint8 images
    (N, H, W, 3).

    `ref_stats` is (mu, sigma) or the path of a statistics .npz; without it "fid" is None. Under
    `jax.distributed` each process passes its own images and gets the figures over all of them.
    Returns {"fid", "inception_score", "inception_score_std", "mu", "sigma", "count"}.
    """
    # read first: a bad path fails before the long pass
    if isinstance(ref_stats, (str, os.PathLike)):
        ref_stats = load_statistics(ref_stats)
    features = InceptionFeatures(inception or load_inception(), batch_size, progress)
    with dit.tqdm(total=len(images), unit="img", desc="Inception",
              disable=not features.progress) as bar:
        features.update(images, bar)
    out = features.result()
    fid = frechet_distance(out["mu"], out["sigma"], *ref_stats) if ref_stats is not None else None
    # IS over 10 splits needs at least 10 images; a tiny evaluation reports FID only.
    score, score_std = inception_score(out["score_logits"]) if out["count"] >= 10 else (None, None)
    return {"fid": fid, "inception_score": score, "inception_score_std": score_std,
            "mu": out["mu"], "sigma": out["sigma"], "count": out["count"]}


def _is_statistics_file(source):
    return (source.endswith(".npz") and os.path.isfile(source)
            and len(dit.read_npz(source, ["mu", "sigma"])) == 2)


def benchmark(batch_sizes, image_size=256, steps=5):
    """Print images/s of the jit-compiled, sharded feature extractor (random weights: speed does not
    depend on them). Each step is timed from host uint8 images to features on the device."""
    inception = dit.random_weights(lambda: InceptionV3(rngs=nnx.Rngs(0)))
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


def _positive_ints(text):
    return [dit.positive_int(part) for part in text.split(",")]


def main(argv=None):
    parser = dit.OneLineParser(description="FID and Inception Score with pytorch-fid's "
                                     "InceptionV3, in JAX. A source is a folder of images, an .npz "
                                     "of uint8 images (arr_0) or, where statistics suffice, an "
                                     ".npz of statistics (mu, sigma).")
    commands = parser.add_subparsers(dest="command", required=True)
    stats = commands.add_parser("stats", help="save the FID statistics of a source to OUT.npz")
    stats.add_argument("source")
    stats.add_argument("out")
    distance = commands.add_parser("fid", help="FID between two sources (e.g. samples.npz and "
                                   "reference stats)")
    distance.add_argument("source1")
    distance.add_argument("source2")
    score = commands.add_parser("is", help="Inception Score of a source of images")
    score.add_argument("source")
    for command in (stats, distance, score):
        command.add_argument("--weights", help=f"pytorch-fid's {FID_WEIGHTS_NAME} (default: cache, "
                             f"else download)")
        command.add_argument("--batch-size", type=dit.positive_int, default=128,
                             help="images per device per step")
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

    def statistics(source, need_images=False):
        nonlocal inception
        if not need_images and _is_statistics_file(source):
            return load_statistics(source) + (None,)
        images = load_images(source)  # bad sources fail before the weights are fetched
        inception = inception or load_inception(args.weights)
        out = image_statistics(images, inception, args.batch_size)
        say(f"{source}: {out['count']} images")
        return out["mu"], out["sigma"], out["score_logits"]

    if args.command == "stats":
        if _is_statistics_file(args.source):
            raise dit.InputError(
                f"{args.source} already holds statistics (mu, sigma); give images to "
                f"compute them from")
        mu, sigma, _ = statistics(args.source)
        if jax.process_index() == 0:
            save_statistics(args.out, mu, sigma)
        say(f"saved mu {mu.shape} and sigma {sigma.shape} to {args.out}")
    elif args.command == "fid":
        mu1, sigma1, _ = statistics(args.source1)
        mu2, sigma2, _ = statistics(args.source2)
        say(f"FID: {frechet_distance(mu1, sigma1, mu2, sigma2):.4f}")
    elif args.command == "is":
        mean, std = inception_score(statistics(args.source, need_images=True)[2])
        say(f"Inception Score: {mean:.4f} +- {std:.4f} (10 splits)")


# As a script; pasted into a notebook cell (no __file__ there), it only defines its functions.
if __name__ == "__main__" and "__file__" in globals():
    dit.run_cli(main)
