"""Tests of dit.py, fid.py and prepare_imagenet100.py, in the order of dit.py's sections, then
fid.py's and prepare_imagenet100.py's; then every compiled program, lowered for TPUs and NVIDIA
GPUs; last, hostile and damaged files against every command.

Parity tests compare against reference vectors made by running the official implementations
(facebookresearch/DiT, pytorch-fid, diffusers); they read them from $DIT_FIXTURES when it is set,
else from fixtures/. They take every shape, class count, timestep and configuration from the
reference files, so that reference files made the same way for another configuration test the same
things. Tests on real images read $DIT_DATA when it is set, else the few real images in
fixtures/data/. A missing file fails its test.
Run: python -m pytest -q test_dit.py -n 3 --dist loadgroup (README, Tests)
"""
import argparse
import ast
import base64
import contextlib
import dataclasses
import errno
import functools
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import pickle
import queue
import re
import shutil
import shlex
import signal
import socket
import struct
import subprocess
import symtable
import sys
import tarfile
import tempfile
import threading
import time
import tracemalloc
import types
import unittest.mock
import urllib.error
import urllib.request
import warnings
import zipfile
import zlib

import jax
import jax.export
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from PIL import Image
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import dit
import fid
import prepare_imagenet100
from dit import (AutoencoderKL, center_crop_arr, Dataset, GaussianDiffusion, load_dataset, load_vae,
                 load_vae_weights, Loader, read_idx, read_safetensors, RectifiedFlow,
                 space_timesteps, vae_torch_names, VAEConfig)
from dit import UnsafePickleError

HERE = os.path.dirname(os.path.abspath(__file__))
# One CPU device, whatever the cores and whichever test starts JAX: dit.main's split_cpu then leaves
# it as it is. Tests of several devices run processes with XLA_FLAGS of their own.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", 1)
sys.path.insert(0, os.path.join(HERE, "fixtures"))
from random_inception import random_inception_weights  # noqa: E402  (the reference scripts' rule)

# Tests that take seconds each (a process, a kernel, a training run, a large network) are marked
# slow: `python -m pytest -q test_dit.py -m "not slow"` runs the rest, a quick subset for an edit
# loop. The mark is not registered (the project has no conftest.py), so pytest's warning is quiet.
warnings.filterwarnings("ignore", "Unknown pytest.mark.slow")
slow = pytest.mark.slow
# The README's command runs the tests in three processes (pytest-xdist's `-n 3 --dist loadgroup`)
# on two cores: most of a test's time is XLA's compiler on one core, or a process it waits on (the
# SLURM tests' jobs, the third process's time). The SLURM tests share one worker, so that their
# jobs do not wait in the one node's queue behind each other's. So do the tests that read the same
# module fixture's run (straight_run and two_hosts, lever_run, masked_run, course_data), so that
# the run is made once rather than once in each worker (10 to 20 s apiece).
warnings.filterwarnings("ignore", "Unknown pytest.mark.xdist_group")
one_slurm = pytest.mark.xdist_group("slurm")

# The tests and the commands that they run as processes would each compile their functions anew:
# a compilation cache shared by the whole test run, its workers (pytest-xdist's) and the processes
# they start, compiles each function once (a short training run: 21 s without it, 7 s with it), and
# so, through SHARED_PROGRAMS, does the second process of a pair joined by jax.distributed. It lies
# in the run's temporary folder, which pytest keeps for the last three runs.
@pytest.fixture(scope="session", autouse=True)
def compilation_cache_of_the_run(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()  # under xdist, a folder per worker in the run's
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla-cache"
    os.environ.update(JAX_COMPILATION_CACHE_DIR=str(cache),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    dit.use_compile_cache(str(cache))  # this process read JAX's settings at import

# The processes that the tests start would each compile dit.py's and fid.py's source to bytecode (a
# quarter of a second of CPU apiece) where the environment says to write none
# (PYTHONDONTWRITEBYTECODE): they keep it in __pycache__/ (which git ignores), compiled once.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The tests spend most of their time in XLA's compiler, on small programs that run in moments:
# without LLVM's optimisations it compiles in about half the time, and in a third of that again with
# its CPU compiler's older emitters rather than its fusion emitters (a training step: 3.0 s of CPU
# rather than 8-9 s), where it still has them (jax 0.10.2 does; 0.12.0.1 has the fusion emitters
# alone). XLA ends a process at a flag it does not know, so a small process asks first. This process
# (from its first computation: XLA reads XLA_FLAGS as JAX starts) and those it starts compile so.
# Numbers then differ from optimised code's in the last bit, far inside the references' tolerances;
# one parity test compiles the model as a user's code is (test_jit_compiled_model_matches_official).
def xla_knows(flag):
    """Whether XLA starts with `flag` in XLA_FLAGS, in a process of its own."""
    return subprocess.run([sys.executable, "-c", "import jaxlib.xla_client; "
                           "jaxlib.xla_client.make_cpu_client()"], env={**os.environ,
                          "XLA_FLAGS": flag}, capture_output=True).returncode == 0

OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
UNOPTIMISED = ("--xla_backend_optimization_level=0"
               + (f" {OLDER_EMITTERS}" if xla_knows(OLDER_EMITTERS) else ""))
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {UNOPTIMISED}".strip()
# jax.jit's compiler_options for a program compiled as a user's is
OPTIMISED = {"xla_backend_optimization_level": 3,
             **({"xla_cpu_use_fusion_emitters": True} if OLDER_EMITTERS in UNOPTIMISED else {})}

def process_env(devices):
    """The environment of a process that the tests start: `devices` CPU devices, unoptimised."""
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {UNOPTIMISED}"}

@pytest.fixture(autouse=True)
def compilation_cache_restored():
    """A training run that a test starts in this process (dit.main) may set JAX's compilation cache
    to its own (--compile-cache): the test run's again after the test."""
    yield
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    if not jax.config.jax_enable_compilation_cache or jax.config.jax_compilation_cache_dir != cache:
        dit.use_compile_cache(cache)

def fixture(name):
    """Path of a reference file: $DIT_FIXTURES first, then the project's fixtures/. A missing file
    fails the test: a fresh clone holds every file the tests read."""
    for d in (os.environ.get("DIT_FIXTURES"), os.path.join(HERE, "fixtures")):
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    pytest.fail(f"reference file {name!r} is in neither $DIT_FIXTURES nor fixtures/")

def data(name):
    """Path of real images: under $DIT_DATA when it is set (the full sets), else under
    fixtures/data/ (a few of each). A missing one fails the test."""
    path = os.path.join(os.environ.get("DIT_DATA") or os.path.join(HERE, "fixtures", "data"), name)
    if not os.path.exists(path):
        pytest.fail(f"real images {path} are missing")
    return path

def rel_err(ours, ref):
    """|ours - ref| / |ref| with norms over the whole array, the measure the fixtures README
    uses."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))

def nhwc(a):
    """PyTorch's NCHW reference arrays -> our NHWC."""
    return jnp.asarray(np.asarray(a).transpose(0, 2, 3, 1))

def nchw(a):
    return np.asarray(a).transpose(0, 3, 1, 2)

class RunsCommand:
    """The payload of the hostile pickles below: unpickling it would run `touch marker`, so the
    marker file exists afterwards exactly when a reader ran code from a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)

# Every run below trains this tiny model (DiT-XS as TINY_XS makes it). Runs on several devices, or
# with a patch, run in a fresh process, so that the number of devices (set by XLA_FLAGS before jax
# starts), jax.distributed and the patched names can differ between runs; the process ends as
# `python dit.py` does: a mistake of the user's in one line; and as it does, it imports fid.py (and
# SciPy) only where the run needs FID. Flax imports IPython where it is installed (as the notebook
# tests need), to ask whether it runs in a notebook: half a second of each process's start, where
# the answer is no. A run on one device with nothing patched runs in the test's own process, whose
# one device and compiler flags are those of such a process: a process's start (about 2 s of CPU)
# is much of a short run's cost.
TINY_XS = dict(hidden_size=32, depth=2, num_heads=2)
DRIVER = """
import os, sys
sys.path.insert(0, {here!r})
sys.modules["IPython"] = None
import dit
dit.DIT_SIZES["XS"] = {tiny}
{patch}
dit.run_cli(dit.main)
"""

def driver_text(patch=""):
    """DRIVER with `patch`."""
    return DRIVER.format(here=HERE, tiny=TINY_XS, patch=patch)

# Runs a command and writes its exit status and peak resident memory (KiB) to a file. The peak that
# os.wait4 reports counts what the process the command was forked from held, so the command is
# forked from this small Python rather than from the test's, which grows to gigabytes.
LAUNCHER = """
import os, subprocess, sys, threading
proc = subprocess.Popen(sys.argv[2:])
timer = threading.Timer(300, proc.kill)
timer.start()
_, status, usage = os.wait4(proc.pid, 0)
timer.cancel()
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""

def run_python(args, env, cwd=None):
    """(CompletedProcess, peak resident memory in KiB) of `python *args`, killed after 300 s."""
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "result")
        proc = subprocess.run([sys.executable, "-c", LAUNCHER, result, sys.executable, *args],
                              env=env, cwd=cwd, capture_output=True, text=True, errors="replace")
        with open(result) as f:
            status, peak = map(int, f.read().split())
    return subprocess.CompletedProcess(args, status, proc.stdout, proc.stderr), peak

def run_here(args):
    """`python dit.py *args` as DRIVER runs it, in this process: a CompletedProcess."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with (unittest.mock.patch.dict(dit.DIT_SIZES, XS=TINY_XS),
              contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)):
            dit.run_cli(dit.main, args)
    except SystemExit as e:  # as Python ends on it: a message to stderr, status 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            err.write(e.code + "\n")
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())

def run_dit(tmp_path, args, devices=1, patch="", check=True, env=None):
    if devices == 1 and not patch and not env:
        proc = run_here(args)
    else:
        script = tmp_path / "driver.py"
        script.write_text(driver_text(patch))
        proc, _ = run_python([str(script), *args], {**process_env(devices), **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"dit.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc

@pytest.fixture(scope="module")
def folder_data(tmp_path_factory):
    """A small two-class image folder (8x8 RGB PNGs): bright squares and dark stripes."""
    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for c, name in enumerate(["squares", "stripes"]):
        os.makedirs(root / name)
        for i in range(48):
            img = rng.integers(0, 60, (8, 8, 3), dtype=np.uint8)
            if c == 0:
                img[2:6, 2:6] = 220
            else:
                img[::2] = 200
            Image.fromarray(img).save(root / name / f"{i}.png")
    return str(root)

def train_args(data_dir, run_dir, steps, extra=()):
    return ["--dataset", "folder", "--data-dir", data_dir, "--resolution", "8", "--size", "XS",
            "--patch", "2", "--batch-size", "8", "--steps", str(steps), "--log-every", "1",
            "--ckpt-every", "3", "--sample-every", "1000", "--sample-steps", "2", "--final-fid",
            "0", "--run-dir", str(run_dir), "--lr", "1e-3", "--ema-decay", "0.9", *extra]

def final_state(run_dir):
    meta, arrays = dit.read_checkpoint(dit.list_checkpoints(run_dir)[-1])
    return meta, arrays

def assert_states_close(a, b, rtol=2e-5, atol=2e-6):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)

@pytest.fixture(scope="module")
def reference():
    ref = np.load(fixture("dit_reference.npz"))
    cfg = dit.DiTConfig(**json.loads(str(ref["config"])))
    return ref, cfg, dit.load_dit_checkpoint(fixture("dit_reference.pt"), cfg)

#################################################################################
#                                                                               #
#                            dit.py, PART I: THE CORE                           #
#                                                                               #
#################################################################################

def module_names_read(statement):
    """The names that a top-level statement reads from the module's namespace, in its own scope
    (bases, decorators, defaults, annotations, values) and in every scope inside it."""
    def read(table):
        names = {symbol.get_name() for symbol in table.get_symbols() if symbol.is_referenced()
                 and (table.get_type() == "module" or symbol.is_global())}
        return names.union(*map(read, table.get_children()))
    return read(symtable.symtable(ast.unparse(statement), "dit.py", "exec"))

def test_the_paper_and_what_lies_beyond_it_use_no_later_name():
    """Part I (from the start to the "PART II" banner) and Part II (to the "PART III" banner) each
    read top-down: every name of dit.py's top level that a part's code reads is defined before the
    part ends."""
    with open(os.path.join(HERE, "dit.py")) as f:
        source = f.read()
    lines = source.splitlines()
    banner = lambda part: next(i + 1 for i, line in enumerate(lines)  # noqa: E731
                               if re.match(rf"#\s+{part}:", line))
    ends = {"Part I": banner("PART II"), "Part II": banner("PART III")}
    statements = ast.parse(source).body
    defined = {}  # each top-level name -> the line of its first definition
    for statement in statements:
        table = symtable.symtable(ast.unparse(statement), "dit.py", "exec")
        for symbol in table.get_symbols():
            if symbol.is_local():
                defined.setdefault(symbol.get_name(), statement.lineno)
    later = []
    for statement in statements:
        part = "Part I" if statement.lineno < ends["Part I"] else "Part II"
        if statement.lineno < ends["Part II"]:
            later += [f"{part}, line {statement.lineno}: {name} (line {defined[name]})"
                      for name in sorted(module_names_read(statement))
                      if defined.get(name, 0) > ends[part]]
    assert len(defined) > 200 and ends["Part I"] < ends["Part II"]
    assert not later, "names defined after the part that reads them: " + "; ".join(later)

#################################################################################
#                                1. Configuration                               #
#################################################################################

@slow
def test_parameter_counts_equal_the_official_ones():
    """The official counts (32,963,360 for DiT-S/2 and 675,129,632 for DiT-XL/2) include the fixed
    position table, which PyTorch stores as a frozen parameter. XL/2 is never allocated."""
    for size, official in [("S", 32_963_360), ("XL", 675_129_632)]:
        cfg = dit.DiTConfig(patch_size=2, **dit.DIT_SIZES[size])
        model = dit.abstract_module(dit.DiT, cfg)
        T = cfg.grid ** 2
        assert dit.count_params(model) + T * cfg.hidden_size == official, size

@slow
def test_dit_plus_stays_within_the_course_budget():
    """DiT+ at S/2 on 256x256 images stays within 33M parameters (the official count's convention,
    position table included). Counted by hand: SwiGLU's three matrices of width 2/3 * 4D replace
    the MLP's two of width 4D; QK-norm adds a scale per head channel for queries and keys; RMSNorm
    and RoPE add none."""
    def total(**switches):
        cfg = dit.DiTConfig(patch_size=2, **dit.DIT_SIZES["S"], **switches)
        model = dit.abstract_module(dit.DiTPlus, cfg)
        return dit.count_params(model) + cfg.grid ** 2 * cfg.hidden_size

    D, depth, heads, official = 384, 12, 6, 32_963_360
    h = 2 * 4 * D // 3
    mlp, swiglu = 2 * D * 4 * D + 4 * D + D, D * 2 * h + 2 * h + h * D + D
    assert total(swiglu=True) == official + depth * (swiglu - mlp)
    assert total(qk_norm=True) == official + depth * 2 * (D // heads)
    assert total(rms_norm=True) == total(rope=True) == official
    assert total(**dit.ARCHS["dit+"]) <= 33_000_000

@slow
def test_any_input_size_channels_and_unconditional():
    cfg = dit.DiTConfig(input_size=12, patch_size=4, in_channels=1, hidden_size=32, depth=1,
                        num_heads=2, num_classes=0, learn_sigma=False)
    model = dit.DiT(cfg, rngs=nnx.Rngs(0))
    assert not hasattr(model, "y_embedder")
    assert (model(jnp.ones((3, 12, 12, 1)), jnp.ones(3), jnp.zeros(3, jnp.int32)).shape
            == (3, 12, 12, 1))
    with pytest.raises(dit.InputError, match="does not divide the input size 10"):
        dit.DiTConfig(input_size=10, patch_size=4)

def test_versions_older_than_the_minimum_are_named():
    dit.check_versions({"jax": "0.12.0.1", "flax": "0.12.0", "optax": "0.2.5"})  # the minimums pass
    dit.check_versions({"jax": "0.13.0.dev20260101"})  # as do pre-releases of later versions
    with pytest.raises(dit.InputError, match=r"found optax 0\.2\.4; .* pip install -U "
                                             r"'optax>=0\.2\.5', then restart"):
        dit.check_versions({"jax": "0.10.2", "optax": "0.2.4"})

# A notebook image with flax 0.10.7 and jax 0.6.2 (a clean venv of them fails in dit.py on
# nnx.List); the import sees those versions, which `python -c` of this text sets before it. Its
# __main__ is the prompt's, which has no file, unless runpy runs a script.
OLD_RELEASES = """
import runpy, sys
import flax, jax
flax.__version__, jax.__version__ = "0.10.7", "0.6.2"
sys.path.insert(0, {here!r})
if sys.argv[1] == "import":
    try:
        import dit
    except ValueError as e:
        print(type(e).__name__, e)
else:
    runpy.run_path(sys.argv[1], run_name="__main__")
"""

@slow
def test_old_releases_end_in_one_line():
    """As a script, dit.py, fid.py (which imports dit) and prepare_imagenet100.py end in one line
    that names the versions found and needed and the pip command; imported, dit raises
    InputError."""
    driver = [sys.executable, "-c", OLD_RELEASES.format(here=HERE)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for script in ("dit.py", "fid.py", "prepare_imagenet100.py"):
        proc = subprocess.run([*driver, os.path.join(HERE, script), "--help"], env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 1 and proc.stdout == "", proc.stderr
        assert proc.stderr == ("error: found jax 0.6.2, flax 0.10.7; this code needs jax>=0.7.1, "
                               "flax>=0.12.0: pip install -U 'jax>=0.7.1' 'flax>=0.12.0' (for jax "
                               "on a TPU or GPU: jax[tpu] or jax[cuda12]), then restart Python\n")
    proc = subprocess.run([*driver, "import"], env=env, capture_output=True, text=True)
    assert proc.stdout.startswith("InputError found jax 0.6.2, flax 0.10.7;"), proc.stderr

#################################################################################
#                                 2. Embeddings                                 #
#################################################################################

def test_position_table_is_the_official_one(reference):
    ref, cfg, _ = reference
    state = dit.load_torch(fixture("dit_reference.pt"))
    np.testing.assert_allclose(dit.sincos_pos_embed_2d(cfg.hidden_size, cfg.grid),
                               state["pos_embed"][0], atol=1e-6)

def test_label_dropout_uses_the_null_label(reference):
    _, cfg, model = reference
    n, p = 4096, cfg.class_dropout_prob
    y = jnp.arange(n) % cfg.num_classes
    emb = model.y_embedder(y, jax.random.key(0))
    null = model.y_embedder.embedding_table.embedding[...][cfg.num_classes]
    dropped = np.all(np.isclose(np.asarray(emb), np.asarray(null)), axis=1)
    assert abs(dropped.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)  # a fraction p of the labels
    np.testing.assert_array_equal(np.asarray(model.y_embedder(y)),
                                  np.asarray(model.y_embedder.embedding_table(y)))

#################################################################################
#                                3. The DiT model                               #
#################################################################################

@slow
def test_model_output_matches_official(reference):
    ref, _, model = reference
    out = model(nhwc(ref["x"]), jnp.asarray(ref["t"]), jnp.asarray(ref["y"]))
    assert rel_err(nchw(out), ref["out"]) < 1e-5

def test_cfg_forward_matches_official(reference):
    ref, _, model = reference
    out = model.forward_with_cfg(nhwc(ref["cfg_x"]), jnp.asarray(ref["cfg_t"]),
                                 jnp.asarray(ref["cfg_y"]), float(ref["cfg_scale"]),
                                 guidance_channels=3)
    assert rel_err(nchw(out), ref["cfg_out"]) < 1e-5

def test_cfg_all_channels_and_interval(reference):
    """Guidance on all channels changes the noise channels past the third and never the variance;
    outside the guidance interval the output is the conditional prediction."""
    ref, cfg, model = reference
    x, t, y = nhwc(ref["cfg_x"]), jnp.asarray(ref["cfg_t"]), jnp.asarray(ref["cfg_y"])
    three = np.asarray(model.forward_with_cfg(x, t, y, 4.0, guidance_channels=3))
    every = np.asarray(model.forward_with_cfg(x, t, y, 4.0))
    C = cfg.in_channels
    np.testing.assert_array_equal(three[..., :3], every[..., :3])
    if C > 3:
        assert not np.allclose(three[..., 3:C], every[..., 3:C])
    np.testing.assert_array_equal(three[..., C:], every[..., C:])
    B = len(x) // 2
    cond = np.asarray(model(jnp.concatenate([x[:B], x[:B]]), t, y))
    lo, hi = float(t.min()), float(t.max())
    outside = np.asarray(model.forward_with_cfg(x, t, y, 4.0, interval=(hi + 1, hi + 2)))
    np.testing.assert_allclose(outside[:B], cond[:B], rtol=1e-6, atol=1e-6)
    inside = np.asarray(model.forward_with_cfg(x, t, y, 4.0, interval=(lo, hi)))
    np.testing.assert_allclose(inside, every, rtol=1e-6, atol=1e-6)

@slow
def test_official_initialisation():
    cfg = dit.DiTConfig(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2,
                        num_heads=4, num_classes=10)
    model = dit.DiT(cfg, rngs=nnx.Rngs(0))
    # adaLN-Zero: every modulation and the output layer start at zero, so each block is the identity
    for blk in model.blocks:
        assert not np.any(blk.adaLN_modulation.layers[1].kernel[...])
    assert not np.any(model.final_layer.linear.kernel[...])
    out = model(jnp.ones((2, 8, 8, 4)), jnp.array([3.0, 7.0]), jnp.array([1, 10]))
    assert out.shape == (2, 8, 8, 8) and not np.any(np.asarray(out))
    # embeddings normal(0.02); Xavier-uniform bound sqrt(6 / (fan_in + fan_out)) for the linears
    assert np.std(model.y_embedder.embedding_table.embedding[...]) == pytest.approx(0.02, rel=0.15)
    assert np.std(model.t_embedder.mlp.layers[0].kernel[...]) == pytest.approx(0.02, rel=0.1)
    qkv = np.asarray(model.blocks[0].attn.qkv.kernel[...])
    assert (np.abs(qkv).max() <= np.sqrt(6 / (64 + 192))
            and np.abs(qkv).max() > 0.9 * np.sqrt(6 / (64 + 192)))
    patch = np.asarray(model.x_embedder.proj.kernel[...])  # fan-in is the flattened 2x2x4 patch
    assert (np.abs(patch).max() <= np.sqrt(6 / (16 + 64))
            and np.abs(patch).max() > 0.8 * np.sqrt(6 / (16 + 64)))
    assert model.y_embedder.embedding_table.embedding[...].shape == (11, 64)  # the extra null label

@slow
def test_remat_and_16_bit_floats_match_fp32(reference):
    ref, cfg, model = reference
    x, t, y = nhwc(ref["x"]), jnp.asarray(ref["t"]), jnp.asarray(ref["y"])
    params = nnx.state(model, nnx.Param)

    def value_and_grad(**kwargs):
        graphdef = nnx.graphdef(dit.DiTPlus(cfg, rngs=nnx.Rngs(0), **kwargs))
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(x, t, y) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    l0, g0 = value_and_grad()
    for remat in dit.REMAT_POLICIES:
        l1, g1 = value_and_grad(remat=remat)
        assert float(l1) == pytest.approx(float(l0), rel=1e-6), remat
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=remat)
    # bfloat16 keeps 8 bits of mantissa, float16 11. XLA's attention multiplies float16 matrices
    # into float32 (the F16_F16_F32 algorithm), which GPUs have and XLA's CPU backend lacks.
    assert float(value_and_grad(dtype=jnp.bfloat16)[0]) == pytest.approx(float(l0), rel=2e-2)
    if jax.default_backend() == "gpu":
        assert float(value_and_grad(dtype=jnp.float16)[0]) == pytest.approx(float(l0), rel=4e-3)

def test_rms_norm_and_swiglu_compute_their_formulas():
    x = np.random.default_rng(0).normal(3.0, 2.0, (2, 5, 8)).astype(np.float32)
    expected = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(dit.rms_norm(jnp.asarray(x)), expected, rtol=1e-5)
    mlp = dit.SwiGLU(8, 6, dtype=jnp.float32, rngs=nnx.Rngs(0))
    w12, b12 = np.asarray(mlp.w12.kernel[...]), np.asarray(mlp.w12.bias[...])
    a, b = np.split(x @ w12 + b12, 2, axis=-1)
    w3, b3 = np.asarray(mlp.w3.kernel[...]), np.asarray(mlp.w3.bias[...])
    by_hand = (a / (1 + np.exp(-a)) * b) @ w3 + b3
    np.testing.assert_allclose(mlp(jnp.asarray(x)), by_hand, rtol=1e-5, atol=1e-6)

def test_rope_depends_on_relative_positions_only():
    """RoPE rotates queries and keys by their patch's position, so that q . k depends only on the
    offset between the two patches, in rows and in columns; the rotation keeps lengths."""
    head_dim, grid = 16, 5
    cos, sin = dit.rope_tables(head_dim, grid)
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, head_dim)).astype(np.float32)
    T = grid * grid
    def rot(v):  # (head_dim,) -> (T, head_dim): v placed at every position, rotated there
        return np.asarray(dit.apply_rope(jnp.tile(v, (1, T, 1, 1)), cos, sin))[0, :, 0]
    rq, rk = rot(q), rot(k)  # (T, head_dim): the vector at every position
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q), rtol=1e-5)
    np.testing.assert_allclose(rq[0], q, rtol=1e-6)  # the first patch is not rotated
    pos = lambda r, c: r * grid + c  # noqa: E731
    for (r1, c1), (r2, c2), (dr, dc) in [((0, 0), (1, 3), (2, 1)), ((3, 1), (0, 4), (1, 0))]:
        np.testing.assert_allclose(rq[pos(r1, c1)] @ rk[pos(r2, c2)],
                                   rq[pos(r1 + dr, c1 + dc)] @ rk[pos(r2 + dr, c2 + dc)],
                                   rtol=1e-4, atol=1e-5)
    # ... and it does depend on the offset, along both axes
    assert abs(rq[pos(0, 0)] @ rk[pos(0, 1)] - rq[pos(0, 0)] @ rk[pos(0, 2)]) > 1e-3
    assert abs(rq[pos(0, 0)] @ rk[pos(1, 0)] - rq[pos(0, 0)] @ rk[pos(2, 0)]) > 1e-3

@slow
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    attn = dit.DiTPlusAttention(32, 4, qk_norm=True, rope_grid=None, dtype=jnp.float32,
                                rngs=nnx.Rngs(0))
    plain = dit.Attention(32, 4, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 32))
    for layer, invariant in [(attn, True), (plain, False)]:
        out = layer(x)
        w = layer.qkv.kernel[...]
        layer.qkv.kernel[...] = w.at[:, :64].multiply(20.0)  # queries and keys 20 times larger
        assert np.allclose(layer(x), out, rtol=1e-4, atol=1e-5) == invariant
        layer.qkv.kernel[...] = w

def test_validation_losses_leave_the_padding_out():
    """The losses of n held-out samples padded to a longer batch are those of the n alone: the
    noise is drawn for the n, and the padding's losses are dropped."""
    model = lambda x, t, y: 0.5 * x + y[:, None, None, None]  # noqa: E731  (any function of them)
    losses = jax.jit(lambda x, y, n: dit.validation_losses(model, dit.RectifiedFlow(), x, y,
                                                           jax.random.key(1), n),
                     static_argnums=2)
    x = jax.random.normal(jax.random.key(0), (5, 8, 8, 3))
    y = jnp.arange(5) % 3
    alone = losses(x, y, None)
    padding = jax.random.normal(jax.random.key(2), (3, 8, 8, 3))
    padded = losses(jnp.concatenate([x, padding]), jnp.concatenate([y, y[:3]]), 5)
    assert alone.shape == padded.shape == (len(dit.VAL_TIMES), 5)
    np.testing.assert_allclose(padded, alone, rtol=1e-6)

@slow
def test_dit_plus_trains_and_each_switch_changes_the_model():
    """DiT+ trains in a jitted step (the validation loss of the batch, at fixed noise and times,
    falls), and each of its switches changes the function the model computes: with the same
    random weights, RoPE and RMSNorm alone change the output (SwiGLU and QK-norm change the
    parameters themselves, as the parameter count shows)."""
    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
    t, y = jnp.linspace(0, 1000, 8), jnp.arange(8) % 3
    small = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=2, num_heads=2,
                 num_classes=3, learn_sigma=False)
    tx = dit.make_optimizer(1e-2)[0]
    mesh = dit.make_mesh()
    graphdef, state, shardings = dit.init_state(dit.DiTConfig(**small, **dit.ARCHS["dit+"]), tx,
                                                0, mesh, False, jnp.float32, None)
    step = dit.jit_train_step(graphdef, dit.RectifiedFlow(), tx, 0.9, False, 0, mesh, shardings)
    val = jax.jit(lambda p: dit.validation_losses(
        nnx.merge(graphdef, p), dit.RectifiedFlow(), x, y, jax.random.key(1)).mean())
    before = float(val(state["params"]))
    for _ in range(15):
        state, _ = step(state, x, y)
    assert float(val(state["params"])) < before - 0.02

    def output(**switch):  # the same random weights (adaLN-Zero would hide every difference)
        model = nnx.eval_shape(lambda: dit.DiTPlus(dit.DiTConfig(**small, **switch),
                                                   rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(model)
        params = jax.tree.map(lambda p: np.random.default_rng(p.size).standard_normal(
            p.shape, np.float32), params)
        return jax.jit(lambda params: nnx.merge(graphdef, params)(x, t, y))(params)

    plain = output()
    for switch in ("rope", "rms_norm"):
        changed = output(**{switch: True})
        assert not np.allclose(changed, plain, rtol=1e-3, atol=1e-3), switch

def test_attention_implementation_is_chosen_by_device_and_dtype():
    def gpu(capability):
        return types.SimpleNamespace(platform="gpu", compute_capability=capability)
    choose = dit.attention_implementation
    assert choose(jnp.bfloat16, 64, gpu("9.0")) == choose(jnp.float16, 72, gpu("8.0")) == "cudnn"
    assert choose(jnp.float32, 64, gpu("9.0")) == "xla"  # float32: XLA's, which is exact
    assert choose(jnp.float16, 64, gpu("7.5")) == "xla"  # the T4: no flash attention in cuDNN
    assert choose(jnp.bfloat16, 256, gpu("9.0")) == choose(jnp.bfloat16, 60, gpu("9.0")) == "xla"
    assert choose(jnp.bfloat16, 64, types.SimpleNamespace(platform="tpu")) == "xla"
    assert choose(jnp.bfloat16, 64, types.SimpleNamespace(platform="cpu")) == "xla"

def test_attention_computes_softmax_attention():
    """What runs on this machine against the formula. On a CPU that is XLA's attention, the
    fallback; cuDNN's fused attention is compared with it by the next test, on a GPU only."""
    attn = dit.Attention(32, 4, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 32))
    qkv = np.asarray(attn.qkv(x)).reshape(2, 6, 3, 4, 8)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(2, 6, 32)
    np.testing.assert_allclose(attn(x), attn.proj(jnp.asarray(out)), rtol=1e-4, atol=1e-5)

@pytest.mark.skipif(dit.attention_implementation(jnp.bfloat16, 64) != "cudnn",
                    reason="cuDNN's fused attention needs an NVIDIA GPU from Ampere on")
def test_cudnn_attention_matches_xla():
    q, k, v = jax.random.normal(jax.random.key(0), (3, 4, 256, 6, 64), jnp.bfloat16)
    fused = jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    plain = jax.nn.dot_product_attention(q, k, v, implementation="xla")
    assert rel_err(np.asarray(fused, np.float32), np.asarray(plain, np.float32)) < 1e-2

@slow
def test_float32_means_float32_matrix_products():
    """A float32 model asks XLA for full-precision products (else TF32 on NVIDIA GPUs, one bfloat16
    pass on TPUs), in the forward pass and in the backward; a bfloat16 model leaves the default."""
    cfg = dit.DiTConfig(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=1,
                        num_heads=2, num_classes=3, rope=True, qk_norm=True)
    x, t, y = jnp.zeros((2, 8, 8, 4)), jnp.ones(2), jnp.zeros(2, jnp.int32)

    def precisions(dtype):
        graphdef, params = nnx.split(dit.DiTPlus(cfg, dtype=dtype, remat="dots",
                                                 rngs=nnx.Rngs(0)))
        loss = lambda p: nnx.merge(graphdef, p)(x, t, y).sum()  # noqa: E731
        found = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                    found.append(eqn.params["precision"])
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)
        walk(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
        return found

    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    full = precisions(jnp.float32)
    assert len(full) > 20 and all(p == highest for p in full)
    assert not any(p == highest for p in precisions(jnp.bfloat16))

@slow
def test_remat_keeps_only_block_inputs_for_the_backward_pass():
    """The memory remat saves: the residuals jax.vjp holds for the backward pass (the leaves of the
    function it returns). Without remat every block keeps its attention probabilities and the inputs
    of its matmuls (the GELU and LayerNorm are recomputed); with "full", little more than its input
    (B, T, D)."""
    cfg = dit.DiTConfig(input_size=16, patch_size=4, in_channels=4, num_classes=10,
                        **dit.DIT_SIZES["XS"])
    B, T, D = 24, cfg.grid ** 2, cfg.hidden_size
    x, t, y = jnp.zeros((B, 16, 16, 4)), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32)

    def residual_bytes(remat):
        graphdef, params = nnx.split(dit.DiTPlus(cfg, remat=remat, rngs=nnx.Rngs(0)))
        _, backward = jax.vjp(lambda p: nnx.merge(graphdef, p)(x, t, y), params)
        # activations, not weights
        return sum(r.nbytes for r in jax.tree.leaves(backward) if r.shape[:1] == (B,))

    block_input = B * T * D * 4  # float32
    # Without remat a block keeps about 21 block inputs' worth; 37 if the GELU kept its
    # intermediates. "dots" keeps the matrix products' outputs (qkv 3, proj 1, MLP 4 + 1) and the
    # input; "full" the input, plus the final layer's share.
    assert 15 * cfg.depth * block_input < residual_bytes(None) < 25 * cfg.depth * block_input
    assert 9 * cfg.depth * block_input < residual_bytes("dots") < 12 * cfg.depth * block_input
    assert residual_bytes("full") < 3 * cfg.depth * block_input

def test_jit_compiled_model_matches_official(reference):
    """The guided model compiled with XLA's optimisations, as a user's code is (the tests' own
    programs compile without LLVM's)."""
    ref, _, model = reference
    scale = float(ref["cfg_scale"])
    graphdef, params = nnx.split(model)
    f = jax.jit(lambda p, x, t, y: nnx.merge(graphdef, p).forward_with_cfg(
        x, t, y, scale, guidance_channels=3), compiler_options=OPTIMISED)
    out = f(params, nhwc(ref["cfg_x"]), jnp.asarray(ref["cfg_t"]), jnp.asarray(ref["cfg_y"]))
    assert rel_err(nchw(out), ref["cfg_out"]) < 1e-5

#################################################################################
#                                    4. DDPM                                    #
#################################################################################

# Data x0 ~ N(M, S^2) in every dimension. Every noised variable below is a linear mix of x0 and an
# independent eps ~ N(0, 1), so (x0, eps, x_t) are jointly Gaussian and the ideal network outputs,
# conditional expectations given x_t, are affine in x_t:
# E[a | x_t] = E[a] + Cov(a, x_t) / Var(x_t) (x_t - E[x_t]). The exact transport from noise to data
# along any such deterministic flow is then the monotone affine map z -> M + S z, which gives a
# sample-by-sample target free of Monte-Carlo error.
M, S = 1.5, 0.5

N = 20000

MEAN_TOL = 5 * S / np.sqrt(N)                 # 5 standard errors of a sample mean

VAR_TOL = 5 * S ** 2 * np.sqrt(2 / N)         # 5 standard errors of a sample variance

def rf_exact_velocity(x, t1000, m=M, s=S):
    """E[eps - x0 | x_t] for x_t = (1 - t) x0 + t eps; the network is given 1000 t."""
    t = (t1000 / 1000.0).reshape((-1,) + (1,) * (x.ndim - 1))
    mean_t = (1 - t) * m
    var_t = (1 - t) ** 2 * s ** 2 + t ** 2
    cov_t = t - (1 - t) * s ** 2                      # Cov(eps - x0, x_t)
    return -m + cov_t / var_t * (x - mean_t)

def ddpm_alphas_cumprod():
    """alpha-bar of Ho et al.'s linear schedule, beta from 1e-4 to 0.02 over 1000 steps."""
    return np.cumprod(1.0 - np.linspace(1e-4, 0.02, 1000))

def ddpm_exact_model(var_value):
    """E[eps | x_t] for x_t = sqrt(abar) x0 + sqrt(1 - abar) eps, abar looked up at the ORIGINAL
    timestep the model is given, plus a constant variance output. Fed respaced indices instead, it
    would be wrong."""
    table = jnp.asarray(ddpm_alphas_cumprod(), jnp.float32)

    def model_fn(x, t):
        ab = table[t.astype(jnp.int32)].reshape(-1, 1, 1, 1)
        var_t = ab * S ** 2 + 1 - ab
        eps = jnp.sqrt(1 - ab) / var_t * (x - jnp.sqrt(ab) * M)
        return jnp.concatenate([eps, jnp.full_like(eps, var_value)], axis=-1)
    return model_fn

@pytest.fixture(scope="module")
def gaussian_noise():
    z = jax.random.normal(jax.random.PRNGKey(0), (N, 1, 1, 1))
    return z, M + S * z  # noise, and where the exact flow takes it

def moment_error(x, target):
    return abs(float(x.mean() - target.mean())) + abs(float(x.var() - target.var()))

def test_space_timesteps_examples():
    # the DDIM striding: every k-th step from 0
    assert space_timesteps(1000, "ddim25") == list(range(0, 1000, 40))
    assert space_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    assert space_timesteps(1000, "1000") == list(range(1000))
    # the official docstring's example: 300 steps in sections of 100 taking 10, 15 and 20 steps,
    # each section's first and last step included
    steps = space_timesteps(300, "10,15,20")
    sections = [[s for s in steps if lo <= s < lo + 100] for lo in (0, 100, 200)]
    assert [len(s) for s in sections] == [10, 15, 20]
    assert sections[0] == list(range(0, 100, 11))  # stride 99 / 9 = 11 exactly
    assert [(s[0], s[-1]) for s in sections] == [(0, 99), (100, 199), (200, 299)]
    with pytest.raises(ValueError, match="no integer stride"):
        space_timesteps(1000, "ddim999")
    with pytest.raises(ValueError, match="cannot take"):
        space_timesteps(300, "10,150,20")
    with pytest.raises(ValueError, match="'ddimN'"):
        space_timesteps(1000, "fast")

@pytest.mark.parametrize("respacing", ["", "250", "ddim25", "10,15,20"])
def test_respaced_chain_keeps_alpha_bar(respacing):
    """Respacing keeps alpha-bar at the kept steps (Nichol & Dhariwal 2021, section 4)."""
    diffusion = GaussianDiffusion(respacing)
    kept = ddpm_alphas_cumprod()[diffusion.timestep_map]
    assert diffusion.num_timesteps == len(diffusion.timestep_map)
    np.testing.assert_allclose(diffusion.alphas_cumprod, kept, rtol=1e-12)

@slow
def test_p_mean_variance_mathematics():
    """Given the true noise, the x_0 prediction inverts q(x_t | x_0); the variance output -1 / +1
    selects the posterior variance / beta_t (Nichol & Dhariwal eq. 15); the mean is the posterior
    mean."""
    diffusion = GaussianDiffusion("50")
    betas = 1 - diffusion.alphas_cumprod / np.append(1.0, diffusion.alphas_cumprod[:-1])
    ab = diffusion.alphas_cumprod
    ab_prev = np.append(1.0, ab[:-1])
    t = jnp.array([1, 7, 25, 49])
    k0, k1 = jax.random.split(jax.random.PRNGKey(5))
    x0 = jax.random.normal(k0, (4, 4, 4, 2))
    noise = jax.random.normal(k1, x0.shape)
    abt = ab[np.asarray(t)].reshape(-1, 1, 1, 1)
    x_t = np.sqrt(abt) * x0 + np.sqrt(1 - abt) * noise
    for v, want_var in ((-1.0, betas * (1 - ab_prev) / (1 - ab)), (1.0, betas)):
        out = diffusion.p_mean_variance(jnp.concatenate([noise, jnp.full_like(noise, v)], -1),
                                        jnp.asarray(x_t), t)
        np.testing.assert_allclose(out["pred_xstart"], x0, atol=2e-4)
        np.testing.assert_allclose(out["log_variance"][:, 0, 0, 0], np.log(want_var[np.asarray(t)]),
                                   rtol=1e-5)
    # posterior mean of q(x_{t-1} | x_t, x_0), Ho et al. eq. 7
    bt, abp = betas[np.asarray(t)].reshape(-1, 1, 1, 1), ab_prev[np.asarray(t)].reshape(-1, 1, 1, 1)
    mean = np.sqrt(abp) * bt / (1 - abt) * x0 + np.sqrt(1 - bt) * (1 - abp) / (1 - abt) * x_t
    np.testing.assert_allclose(out["mean"], mean, atol=2e-4)

@slow
def test_vb_trains_only_the_variance():
    """The stop-gradient on the mean: d vb / d eps = 0 and d mse / d variance = 0 (official
    `frozen_out`)."""
    diffusion = GaussianDiffusion()
    x0 = jax.random.normal(jax.random.PRNGKey(6), (4, 4, 4, 2))
    t = jnp.array([0, 3, 400, 999])
    noise = jax.random.normal(jax.random.PRNGKey(7), x0.shape)

    def term(name, a, b):
        model_fn = lambda x, _: jnp.concatenate([a * x, jnp.full_like(x, b)], axis=-1)  # noqa: E731
        return diffusion.losses_at(model_fn, x0, t, noise)[name].sum()
    grad_vb = jax.grad(lambda ab: term("vb", *ab))((0.5, 0.2))
    grad_mse = jax.grad(lambda ab: term("mse", *ab))((0.5, 0.2))
    assert grad_vb[0] == 0 and grad_vb[1] != 0
    assert grad_mse[1] == 0 and grad_mse[0] != 0

def test_ddim_recovers_gaussian_and_converges(gaussian_noise):
    z, target = gaussian_noise
    model_fn = ddpm_exact_model(0.0)
    rms = []
    for steps in (10, 25, 50, 100):
        x = GaussianDiffusion().sample(model_fn, z, None, steps, "ddim")
        rms.append(float(jnp.sqrt(jnp.mean((x - target) ** 2))))
    # DDIM (eta 0) discretises the probability-flow ODE, whose exact transport is z -> M + S z
    assert all(fine < 0.7 * coarse for coarse, fine in zip(rms, rms[1:])), rms
    assert rms[-1] < 0.02
    assert abs(float(x.mean()) - M) < MEAN_TOL

@pytest.mark.parametrize("var_value", [-1.0, 1.0])
def test_ddpm_ancestral_recovers_gaussian(gaussian_noise, var_value):
    """With 1000 steps both ends of the learned variance range give the data distribution."""
    z = gaussian_noise[0]
    x, traj = GaussianDiffusion().sample(ddpm_exact_model(var_value), z, jax.random.PRNGKey(8),
                                         1000, "ddpm", return_trajectory=True)
    assert traj.shape == (1001,) + z.shape
    np.testing.assert_array_equal(traj[-1], x)
    assert abs(float(x.mean()) - M) < MEAN_TOL
    assert abs(float(x.var()) - S ** 2) < 2 * VAR_TOL

def test_ddpm_rejects_bad_input():
    diffusion = GaussianDiffusion("10")
    x = jnp.zeros((2, 4, 4, 3))
    with pytest.raises(ValueError, match="learn_sigma=True"):
        diffusion.walk(lambda x, t: x, x, method="ddim")
    with pytest.raises(ValueError, match="PRNG key"):
        diffusion.walk(ddpm_exact_model(0.0), x, method="ddpm")
    with pytest.raises(ValueError, match="'ddpm' or 'ddim'"):
        diffusion.walk(ddpm_exact_model(0.0), x, jax.random.PRNGKey(0), method="plms")
    with pytest.raises(ValueError, match="unknown ddpm sampling method 'heun'"):
        diffusion.sample(ddpm_exact_model(0.0), x, None, 10, "heun")
    with pytest.raises(ValueError, match="positive int"):
        diffusion.sample(ddpm_exact_model(0.0), x, None, 0, "ddim")

@pytest.fixture(scope="module")
def ref(reference):
    return reference[0]

@pytest.fixture(scope="module")
def model(reference):
    return reference[2]

def test_ddpm_betas(ref):
    betas = GaussianDiffusion("", len(ref["ddpm_betas"])).betas
    assert rel_err(betas, ref["ddpm_betas"]) < 1e-12

def test_ddpm_loss_terms(ref, model):
    y = jnp.asarray(ref["loss_y"])
    losses = GaussianDiffusion().losses_at(lambda x, t: model(x, t, y), nhwc(ref["loss_x0"]),
                                           jnp.asarray(ref["loss_t"]), nhwc(ref["loss_noise"]))
    for ours, theirs in (("mse", "loss_mse"), ("vb", "loss_vb"), ("loss", "loss_total")):
        assert rel_err(losses[ours], ref[theirs]) < 1e-5, ours

def test_p_mean_variance_250(ref, model):
    diffusion = GaussianDiffusion("250")
    np.testing.assert_array_equal(diffusion.timestep_map, ref["p250_timestep_map"])
    x, index = nhwc(ref["p250_x"]), jnp.asarray(ref["p250_index"])
    out = model(x, jnp.asarray(diffusion.timestep_map[np.asarray(index)], jnp.float32),
                jnp.asarray(ref["p250_y"]))
    p = diffusion.p_mean_variance(out, x, index)
    for name in ("mean", "log_variance", "pred_xstart"):
        assert rel_err(nchw(p[name]), ref[f"p250_{name}"]) < 1e-5, name

def test_ddim25_with_cfg(ref, model):
    diffusion = GaussianDiffusion("ddim25")
    np.testing.assert_array_equal(diffusion.timestep_map, ref["ddim25_timestep_map"])
    y, scale = jnp.asarray(ref["ddim25_y"]), float(ref["ddim25_cfg_scale"])
    model_fn = lambda x, t: model.forward_with_cfg(x, t, y, scale,  # noqa: E731
                                                   guidance_channels=3)
    x = GaussianDiffusion().sample(model_fn, nhwc(ref["ddim25_noise"]), None, 25, "ddim")
    assert rel_err(nchw(x), ref["ddim25_out"]) < 1e-4

#################################################################################
#                               5. Rectified flow                               #
#################################################################################

def test_rf_euler_recovers_gaussian_and_converges(gaussian_noise):
    z, target = gaussian_noise
    rf = RectifiedFlow()
    errors = [moment_error(rf.sample(rf_exact_velocity, z, None, n, "euler"), target)
              for n in (2, 4, 8, 16, 32, 64, 128)]
    # first order: doubling the steps roughly halves the error
    for coarse, fine in zip(errors, errors[1:]):
        assert fine < 0.7 * coarse, errors
    x = rf.sample(rf_exact_velocity, z, None, 128, "euler")
    assert abs(float(x.mean()) - M) < MEAN_TOL
    # Euler's remaining bias at 128 steps is ~0.003
    assert abs(float(x.var()) - S ** 2) < VAR_TOL + 0.005

def test_rf_heun_beats_euler_and_converges(gaussian_noise):
    z, target = gaussian_noise
    rf = RectifiedFlow()
    heun, euler = [], []
    for n in (2, 4, 8, 16):
        heun.append(moment_error(rf.sample(rf_exact_velocity, z, None, n, "heun"), target))
        euler.append(moment_error(rf.sample(rf_exact_velocity, z, None, n, "euler"), target))
    assert all(h < 0.5 * e for h, e in zip(heun, euler)), (heun, euler)
    assert all(fine < coarse for coarse, fine in zip(heun, heun[1:])), heun
    x = rf.sample(rf_exact_velocity, z, None, 16, "heun")
    assert abs(float(x.mean()) - M) < MEAN_TOL
    assert abs(float(x.var()) - S ** 2) < VAR_TOL

def test_rf_trajectory(gaussian_noise):
    z = gaussian_noise[0][:8]
    x, traj = RectifiedFlow().sample(rf_exact_velocity, z, None, 5, "heun",
                                    return_trajectory=True)
    assert traj.shape == (6,) + z.shape
    np.testing.assert_array_equal(traj[0], z)
    np.testing.assert_array_equal(traj[-1], x)

@pytest.mark.parametrize("sampling,loc,scale", [("logit_normal", 0.0, 1.0), ("uniform", 0.0, 1.0)])
@slow
def test_rf_loss_of_exact_field(sampling, loc, scale):
    """The exact field's expected loss is E_t[Var(eps - x0 | x_t)] =
    E_t[1 + S^2 - Cov^2 / Var(x_t)], and any other field does worse."""
    rf = RectifiedFlow(sampling, loc, scale)
    x0 = M + S * jax.random.normal(jax.random.PRNGKey(1), (4096, 4, 4, 1))
    key = jax.random.PRNGKey(2)
    loss = float(rf.training_losses(rf_exact_velocity, x0, key)["loss"].mean())

    # the expectation over t by quadrature: t = sigmoid(loc + scale n) with Gauss-Hermite nodes n,
    # or uniform
    if sampling == "logit_normal":
        nodes, weights = np.polynomial.hermite_e.hermegauss(80)
        t, w = 1 / (1 + np.exp(-(loc + scale * nodes))), weights / weights.sum()
    else:
        t = (np.arange(10000) + 0.5) / 10000
        w = np.full_like(t, 1 / len(t))
    residual = 1 + S ** 2 - (t - (1 - t) * S ** 2) ** 2 / ((1 - t) ** 2 * S ** 2 + t ** 2)
    expected = float(np.sum(w * residual))
    assert abs(loss - expected) < 0.02 * expected, (loss, expected)

    wrong = float(rf.training_losses(lambda x, t: rf_exact_velocity(x, t, m=M + 0.3),
                                     x0, key)["loss"].mean())
    assert wrong > loss + 0.05

def test_rf_timestep_distributions():
    n = 20000
    loc, scale = 0.5, 1.2
    t = np.asarray(RectifiedFlow("logit_normal", loc, scale)
                   .sample_timesteps(jax.random.PRNGKey(3), n))
    assert t.shape == (n,) and np.all((t > 0) & (t < 1))
    # the median of sigmoid(loc + scale n) is sigmoid(loc); its logit is N(loc, scale^2)
    assert abs(np.mean(t < 1 / (1 + np.exp(-loc))) - 0.5) < 4 * np.sqrt(0.25 / n)
    logit = np.log(t / (1 - t))
    assert abs(logit.mean() - loc) < 5 * scale / np.sqrt(n)
    assert abs(logit.std() - scale) < 0.05 * scale
    u = np.asarray(RectifiedFlow("uniform").sample_timesteps(jax.random.PRNGKey(4), n))
    assert np.all((u >= 0) & (u < 1)) and abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)

def test_rf_rejects_bad_input():
    rf = RectifiedFlow()
    x = jnp.zeros((2, 4, 4, 3))
    learned_sigma_model = lambda x, t: jnp.concatenate([x, x], axis=-1)  # noqa: E731
    with pytest.raises(ValueError, match="learn_sigma=False"):
        rf.training_losses(learned_sigma_model, x, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="learn_sigma=False"):
        rf.sample(learned_sigma_model, x, None, 2)
    with pytest.raises(ValueError, match="unknown rf sampling method 'rk4'; use 'euler' or 'heun'"):
        rf.sample(rf_exact_velocity, x, None, 2, method="rk4")
    with pytest.raises(ValueError, match="positive int"):
        rf.sample(rf_exact_velocity, x, None, 0)
    with pytest.raises(ValueError, match="timestep_sampling"):
        RectifiedFlow("cosine")

def edm_exact_model(edm, m=M, s=S):
    """The network F that makes EDM's denoiser the exact one of Gaussian data N(m, s^2),
    D(x; sigma) = m + s^2 / (s^2 + sigma^2) (x - m), written back through the preconditioning of
    Karras et al.'s Table 1 (x enters as c_in x; D = c_skip x + c_out F) and the map of
    c_noise = ln(sigma) / 4 onto DiT's 0..1000 that EDM's docstring gives."""
    sd = edm.sigma_data
    lo, hi = np.log(edm.SIGMA_MIN) / 4, np.log(edm.SIGMA_MAX) / 4

    def model_fn(x_in, t):
        sigma = jnp.exp(4 * (lo + t / 1000 * (hi - lo))).reshape((-1,) + (1,) * (x_in.ndim - 1))
        x = x_in * jnp.sqrt(sigma ** 2 + sd ** 2)
        exact = m + s ** 2 / (s ** 2 + sigma ** 2) * (x - m)
        c_skip = sd ** 2 / (sigma ** 2 + sd ** 2)
        c_out = sigma * sd / jnp.sqrt(sigma ** 2 + sd ** 2)
        return (exact - c_skip * x) / c_out
    return model_fn

@slow
def test_edm_loss_of_the_exact_denoiser():
    """The exact denoiser's expected loss at sigma is lambda(sigma) times the posterior variance,
    (sigma^2 + sd^2) / (sigma sd)^2 * s^2 sigma^2 / (s^2 + sigma^2); over training's log-normal
    sigma, its expectation by quadrature. Any other denoiser does worse. The noise level is
    sigma / (1 + sigma), and time_at inverts it."""
    edm = dit.EDM(sigma_data=0.5)
    sd, model_fn = edm.sigma_data, edm_exact_model(edm)
    x0 = M + S * jax.random.normal(jax.random.PRNGKey(1), (4096, 4, 4, 1))
    noise = jax.random.normal(jax.random.PRNGKey(2), x0.shape)
    def expected_loss(sigma):
        weight = (sigma ** 2 + sd ** 2) / (sigma * sd) ** 2
        return weight * S ** 2 * sigma ** 2 / (S ** 2 + sigma ** 2)

    for sigma in (0.05, 0.5, 5.0):
        out = edm.losses_at(model_fn, x0, jnp.full(len(x0), sigma), noise)
        expected = expected_loss(sigma)
        assert abs(float(out["loss"].mean()) - expected) < 0.02 * expected, sigma
        np.testing.assert_allclose(out["level"], sigma / (1 + sigma), rtol=1e-6)
        np.testing.assert_allclose(edm.time_at(out["level"]), sigma, rtol=1e-5)
    key = jax.random.PRNGKey(3)
    loss = float(edm.training_losses(model_fn, x0, key)["loss"].mean())
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    sigma, w = np.exp(edm.P_MEAN + edm.P_STD * nodes), weights / weights.sum()
    expected = float(np.sum(w * expected_loss(sigma)))
    assert abs(loss - expected) < 0.03 * expected, (loss, expected)
    wrong = float(edm.training_losses(edm_exact_model(edm, m=M + 0.3), x0, key)["loss"].mean())
    assert wrong > loss + 0.05

def test_edm_heun_recovers_gaussian_and_beats_euler(gaussian_noise):
    """Sampling with the exact denoiser carries SIGMA_MAX * noise to the data: the probability-flow
    ODE over the rho = 7 schedule, where Heun's corrections converge faster than Euler's steps."""
    z, target = gaussian_noise
    edm = dit.EDM()
    heun, euler = [], []
    for n in (16, 32, 64):
        heun.append(moment_error(edm.sample(edm_exact_model(edm), z, None, n, "heun"), target))
        euler.append(moment_error(edm.sample(edm_exact_model(edm), z, None, n, "euler"), target))
    assert all(h < 0.7 * e for h, e in zip(heun, euler)), (heun, euler)
    assert all(fine < coarse for coarse, fine in zip(heun, heun[1:])), heun
    x = edm.sample(edm_exact_model(edm), z, None, 64, "heun")
    # the start, SIGMA_MAX * noise, misses the data's mean M; the flow shrinks that by S / SIGMA_MAX
    assert abs(float(x.mean()) - M) < MEAN_TOL + M * S / edm.SIGMA_MAX
    assert abs(float(x.var()) - S ** 2) < VAR_TOL
    x, traj = edm.sample(edm_exact_model(edm), z[:8], None, 5, "heun", return_trajectory=True)
    assert traj.shape == (6,) + z[:8].shape
    np.testing.assert_array_equal(traj[0], z[:8])
    np.testing.assert_array_equal(traj[-1], x)

def test_masked_losses_count_the_masked_elements_only():
    """A mask of 0s and 1s restricts each objective's per-sample loss to its elements: the loss
    of a half-masked batch is the loss of the kept half; mask None is the whole loss."""
    x0 = jax.random.normal(jax.random.PRNGKey(0), (4, 4, 4, 2))
    noise = jax.random.normal(jax.random.PRNGKey(1), x0.shape)
    mask = jnp.zeros((4, 4, 4, 1)).at[:, :2].set(1.0)  # the top half of every image
    for objective, model_fn, t in [
            (GaussianDiffusion(), ddpm_exact_model(0.3), jnp.array([0, 10, 500, 999])),
            (RectifiedFlow(), lambda x, t: 0.7 * x, jnp.linspace(0.1, 0.9, 4)),
            (dit.EDM(), lambda x, t: 0.7 * x, jnp.array([0.1, 1.0, 3.0, 9.0]))]:
        top = lambda x, t, f=model_fn: f(x, t)[:, :2]  # noqa: E731
        whole = objective.losses_at(model_fn, x0, t, noise)["loss"]
        masked = objective.losses_at(model_fn, x0, t, noise, mask)["loss"]
        kept = objective.losses_at(top, x0[:, :2], t, noise[:, :2])["loss"]
        np.testing.assert_allclose(masked, kept, rtol=1e-5, err_msg=objective.name)
        assert not np.allclose(masked, whole, rtol=1e-3), objective.name
        np.testing.assert_array_equal(objective.losses_at(model_fn, x0, t, noise, None)["loss"],
                                      whole)

def test_objectives_are_rebuilt_from_their_records_only():
    """A checkpoint records an objective's name and SETTINGS; make_objective rebuilds it from those
    alone, so that a record claiming other arguments (a chain of 10**12 steps) cannot make it
    allocate anything."""
    for objective in (RectifiedFlow("uniform", 0.5, 2.0), GaussianDiffusion(), dit.EDM(0.7)):
        record = dit.objective_record(objective)
        rebuilt = dit.make_objective(**record, num_timesteps=10 ** 12, timestep_respacing="ddim5")
        assert type(rebuilt) is type(objective) and dit.objective_record(rebuilt) == record
    assert dit.make_objective("ddpm", num_timesteps=10 ** 12).num_timesteps == 1000
    with pytest.raises(dit.InputError, match="unknown objective 'vdm'"):
        dit.make_objective("vdm")

@slow
def test_edm_trains_resumes_and_samples(tmp_path, folder_data):
    """`--objective edm` through the command line: a run resumed at step 3 ends where an
    uninterrupted one does; its checkpoint records the objective, and `sample` draws from it."""
    edm = ["--objective", "edm"]
    run_dit(tmp_path, train_args(folder_data, tmp_path / "straight", 6, edm))
    run_dit(tmp_path, train_args(folder_data, tmp_path / "resumed", 3, edm))
    run_dit(tmp_path, train_args(folder_data, tmp_path / "resumed", 6, edm))
    (meta, straight), (_, resumed) = final_state(tmp_path / "straight"), final_state(
        tmp_path / "resumed")
    assert meta["objective"] == {"name": "edm", "sigma_data": 0.5}
    assert_states_close(straight, resumed)
    ckpt = dit.list_checkpoints(tmp_path / "straight")[-1]
    run_dit(tmp_path, ["sample", "--ckpt", ckpt, "--steps", "3", "--n", "4", "--out",
                       str(tmp_path / "edm.png")])
    assert Image.open(tmp_path / "edm.png").size[0] > 8

#################################################################################
#                              6. The training step                             #
#################################################################################

def test_optimizer_recipe_warmup_and_clipping():
    """AdamW at a constant rate by default; linear warm-up from 0; clipping bounds the global
    gradient norm."""
    params = {"w": jnp.ones(4)}
    tx, schedule = dit.make_optimizer(1e-4)
    assert float(schedule(0)) == float(schedule(10 ** 6)) == pytest.approx(1e-4)
    updates, _ = tx.update({"w": jnp.full(4, 3.0)}, tx.init(params), params)
    # Adam's first step is lr * sign(g), no decay
    np.testing.assert_allclose(updates["w"], -1e-4, rtol=1e-3)
    _, schedule = dit.make_optimizer(1e-4, warmup=100)
    assert ([float(schedule(s)) for s in (0, 50, 100, 1000)]
            == pytest.approx([0.0, 5e-5, 1e-4, 1e-4]))
    # Clipping comes before Adam: our chain on (g1, g2) equals plain AdamW on the clipped gradients,
    # and differs from AdamW on the raw ones (a huge first gradient would otherwise dominate the
    # moments).
    clipped, _ = dit.make_optimizer(1.0, grad_clip=0.5)
    adamw = optax.adamw(1.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    # norms 500, 0.5
    grads = [{"w": jnp.array([300.0, 400.0, 0.0, 0.0])}, {"w": jnp.array([0.3, 0.4, 0.0, 0.0])}]
    by_hand = [jax.tree.map(lambda x: x * min(1.0, 0.5 / float(optax.tree.norm(g))), g)
               for g in grads]
    s_ours, s_ref, s_raw = clipped.init(params), adamw.init(params), adamw.init(params)
    for g, g_clipped in zip(grads, by_hand):
        ours, s_ours = clipped.update(g, s_ours, params)
        ref, s_ref = adamw.update(g_clipped, s_ref, params)
        raw, s_raw = adamw.update(g, s_raw, params)
    np.testing.assert_allclose(ours["w"][:2], ref["w"][:2], rtol=1e-5)
    assert not np.allclose(ours["w"][:2], raw["w"][:2], rtol=0.1)
    # the moments' decays are AdamW's betas
    betas, _ = dit.make_optimizer(1e-3, betas=(0.8, 0.95))
    reference = optax.adamw(1e-3, b1=0.8, b2=0.95, eps=1e-8, weight_decay=0.0)
    s_ours, s_ref = betas.init(params), reference.init(params)
    for g in grads:
        ours, s_ours = betas.update(g, s_ours, params)
        ref, s_ref = reference.update(g, s_ref, params)
    np.testing.assert_allclose(ours["w"], ref["w"], rtol=1e-6)

def test_loss_scaling_skips_overflows_and_adapts():
    """float16 training: a step whose gradients overflowed keeps the old weights, EMA and moments
    and halves the scale; `period` good steps in a row double it. The step count goes on."""
    old = {"step": jnp.int32(5), "params": {"w": jnp.ones(2)}, "ema": {"w": jnp.ones(2)},
           "opt_state": {"mu": jnp.zeros(2)}, "loss_scale": jnp.float32(8.0),
           "good_steps": jnp.int32(2)}
    new = {**old, "step": jnp.int32(6), "params": {"w": jnp.full(2, jnp.nan)},
           "ema": {"w": jnp.full(2, jnp.nan)}, "opt_state": {"mu": jnp.full(2, jnp.inf)}}
    skipped = dit.update_loss_scale(old, new, jnp.bool_(False), period=3)
    assert int(skipped["step"]) == 6 and float(skipped["loss_scale"]) == 4.0
    assert int(skipped["good_steps"]) == 0
    for key in ("params", "ema", "opt_state"):
        for a, b in zip(jax.tree.leaves(skipped[key]), jax.tree.leaves(old[key])):
            np.testing.assert_array_equal(a, b)
    fine = {**new, "params": {"w": jnp.full(2, 0.5)}}
    grown = dit.update_loss_scale(old, fine, jnp.bool_(True), period=3)  # the third good step
    assert float(grown["loss_scale"]) == 16.0 and int(grown["good_steps"]) == 0
    np.testing.assert_array_equal(grown["params"]["w"], 0.5)
    kept = dit.update_loss_scale({**old, "good_steps": jnp.int32(0)}, fine, jnp.bool_(True), 3)
    assert float(kept["loss_scale"]) == 8.0 and int(kept["good_steps"]) == 1
    # only float16 models carry the scale in their training state
    for dtype, scaled in [(jnp.float16, True), (jnp.bfloat16, False), (jnp.float32, False)]:
        assert ("loss_scale" in dit.loss_scale_state(dtype)) == scaled, dtype

@slow
def test_ema_warms_up():
    """With ema_warmup the EMA's decay is min(ema_decay, (1 + step) / (10 + step)); without, the
    constant ema_decay of DiT."""
    cfg = dit.DiTConfig(input_size=4, patch_size=2, in_channels=1, hidden_size=16, depth=1,
                        num_heads=2, num_classes=0, learn_sigma=False)
    tx, _ = dit.make_optimizer(1e-2)
    x, y = jax.random.normal(jax.random.key(1), (4, 4, 4, 1)), jnp.zeros(4, int)
    graphdef, start, _ = dit.init_state(cfg, tx, 0, dit.make_mesh(), False, jnp.float32, None)
    for warmup, decays in [(True, [0.1, 0.15]), (False, [0.15, 0.15])]:  # 1/10, then 2/11 > 0.15
        step = jax.jit(dit.make_train_step(graphdef, dit.RectifiedFlow(), tx, 0.15, 0, warmup))
        state, ema = start, jax.tree.map(np.asarray, start["ema"])
        for d in decays:
            state, _ = step(state, x, y)
            ema = jax.tree.map(lambda e, p: d * e + (1 - d) * np.asarray(p),  # noqa: B023
                               ema, state["params"])
            for a, b in zip(jax.tree.leaves(state["ema"]), jax.tree.leaves(ema)):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

@slow
def test_training_loss_is_logged_by_noise_level():
    """The step sums the per-sample losses in LOSS_BINS equal ranges of t in [0, 1)."""
    time = jnp.array([0.0, 0.1, 0.3, 0.6, 0.99, 0.74, 0.26, 0.2])

    class Known:  # per-sample losses 0..7 at the times above, whatever the model does
        def draw(self, key, x0):
            return time, None

        def losses_at(self, model_fn, x0, t, noise, mask=None):
            return {"loss": jnp.arange(8.0) + 0 * model_fn(x0, t).mean(), "level": t}

    cfg = dit.DiTConfig(input_size=4, patch_size=2, in_channels=1, hidden_size=16, depth=1,
                        num_heads=2, num_classes=0, learn_sigma=False)
    tx, _ = dit.make_optimizer(1e-4)
    mesh = dit.make_mesh()
    graphdef, state, shardings = dit.init_state(cfg, tx, 0, mesh, False, jnp.float32, None)
    step = dit.jit_train_step(graphdef, Known(), tx, 0.9, False, 0, mesh, shardings)
    _, metrics = step(state, jnp.zeros((8, 4, 4, 1)), jnp.zeros(8, int))
    assert dit.LOSS_BINS == 4
    np.testing.assert_array_equal(metrics["count_by_t"], [3, 2, 2, 1])
    np.testing.assert_array_equal(metrics["loss_by_t"], [0 + 1 + 7, 2 + 6, 3 + 5, 4])

#################################################################################
#                                  7. Sampling                                  #
#################################################################################

@slow
def test_samplers_run_every_architecture_and_remat_policy():
    """A model trained with --remat or with every switch of DiT+ on samples under jax.lax.scan
    (jitted, with guidance), and recomputation does not change what the model computes."""
    every_switch = {name: True for name in dit.ARCHS["dit"]}
    cfg = dit.DiTConfig(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=1,
                        num_heads=2, num_classes=3, learn_sigma=False, **every_switch)
    noise, y = jax.random.normal(jax.random.key(0), (2, 8, 8, 3)), jnp.array([0, 1])
    samples = []
    for remat in (None, *dit.REMAT_POLICIES):
        graphdef, params = nnx.split(dit.DiTPlus(cfg, remat=remat, rngs=nnx.Rngs(0)))
        params = jax.tree.map(lambda p: p + 0.05, params)  # past adaLN-Zero's identity

        @jax.jit
        def run(params, graphdef=graphdef):
            return dit.sample(nnx.merge(graphdef, params), dit.RectifiedFlow(), noise, y, None,
                              steps=2, method="euler", cfg_scale=2.0)
        samples.append(np.asarray(run(params)))
    assert np.abs(samples[0] - np.asarray(noise)).max() > 0.1
    for other in samples[1:]:
        np.testing.assert_allclose(other, samples[0], rtol=1e-5, atol=1e-5)

def guidance_models(objective="rf", **overrides):
    """(model, guide, noise, labels): two DiTs of one configuration with different random weights,
    past adaLN-Zero's identity, and their inputs."""
    cfg = tiny_config(objective, **overrides)
    model, guide = (dit.DiTPlus(cfg, rngs=nnx.Rngs(seed)) for seed in (0, 1))
    for m, shift in ((model, 0.05), (guide, -0.03)):
        nnx.update(m, jax.tree.map(lambda p: p + shift, nnx.state(m, nnx.Param)))
    noise = jax.random.normal(jax.random.key(0), (3, 8, 8, cfg.in_channels))
    return model, guide, noise, jnp.array([0, 1, 2])

@slow
@pytest.mark.parametrize("objective, method", [("rf", "heun"), ("ddpm", "ddim")])
def test_autoguidance_is_the_model_where_it_cannot_differ(objective, method):
    """Autoguidance at weight 1 samples as the model alone, bit for bit, and by the model itself at
    any weight within rounding, with and without classifier-free guidance; and CFG alone is the sampler that
    forward_with_cfg drives, as before autoguidance."""
    model, guide, noise, y = guidance_models(objective)
    objective = dit.make_objective(objective)

    @functools.partial(jax.jit, static_argnames=("cfg_scale", "by", "w"))
    def run(cfg_scale, by=None, w=1.0):
        return dit.sample(model, objective, noise, y, None, steps=3, method=method,
                          cfg_scale=cfg_scale, guide={"guide": guide, "model": model}.get(by),
                          guide_scale=w)
    for cfg_scale in (1.0, 2.5):
        alone = np.asarray(run(cfg_scale))
        np.testing.assert_array_equal(run(cfg_scale, "guide", 1.0), alone)
        assert np.abs(np.asarray(run(cfg_scale, "guide", 2.0)) - alone).max() > 1e-3
        # Within rounding: XLA may fuse the two passes differently, or fold out + 2 (out - guide)
        # into 3 out - 2 guide; with CFG the model's half runs in a batch other than the guide's.
        np.testing.assert_allclose(run(cfg_scale, "model", 3.0), alone, rtol=1e-5, atol=1e-5)
    # CFG alone, as the objective's sampler runs forward_with_cfg on the doubled batch
    y2 = jnp.concatenate([y, jnp.full_like(y, model.cfg.num_classes)])
    doubled = jax.jit(lambda: objective.sample(lambda x, t: model.forward_with_cfg(x, t, y2, 2.5),
                                               jnp.concatenate([noise, noise]), None, 3, method))()
    np.testing.assert_array_equal(run(2.5), doubled[:3])

@slow
def test_autoguidance_extrapolates_from_the_guide():
    """One Euler step of rectified flow from t = 1 to 0 is x - v: the velocity guided by another
    network is guide + w * (model - guide) in every channel, and beside CFG its term
    (w - 1) * (cond - guide) adds to CFG's uncond + s * (cond - uncond) (Karras et al. 2024,
    Appendix B.2)."""
    model, guide, noise, y = guidance_models("rf")
    t = jnp.full(3, 1000.0)
    cond, worse = model(noise, t, y), guide(noise, t, y)
    uncond = model(noise, t, jnp.full_like(y, model.cfg.num_classes))
    step = jax.jit(functools.partial(dit.sample, model, dit.RectifiedFlow(), noise, y, None,
                                     steps=1, method="euler", guide=guide, guide_scale=2.5),
                   static_argnames=("cfg_scale", "interval", "guidance_channels"))
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
    close(step(), noise - (worse + 2.5 * (cond - worse)))
    assert np.abs(np.asarray(cond - worse)).max() > 0.1  # the two networks differ
    expected = noise - (uncond + 1.5 * (cond - uncond) + 1.5 * (cond - worse))
    close(step(cfg_scale=1.5), expected)
    # the guidance interval limits CFG alone: outside it autoguidance still acts
    outside = step(cfg_scale=1.5, interval=(0, 10))
    close(outside, noise - (worse + 2.5 * (cond - worse)))
    # the first 3 of the 4 channels guided, as the official FID figures were sampled
    three = np.asarray(step(guidance_channels=3))
    close(three[..., 3], (noise - cond)[..., 3])

@slow
def test_sampling_errors_are_clear(tmp_path):
    cfg = dit.DiTConfig(input_size=8, patch_size=4, in_channels=1, hidden_size=16, depth=1,
                        num_heads=2, num_classes=3, class_dropout_prob=0.0, learn_sigma=False)
    model = dit.DiT(cfg, rngs=nnx.Rngs(0))
    noise, y = jnp.zeros((2, 8, 8, 1)), jnp.array([0, 1])
    with pytest.raises(ValueError, match="null label"):  # no null row to guide with
        dit.sample(model, dit.RectifiedFlow(), noise, y, None, steps=2, method="euler",
                   cfg_scale=4.0)
    assert dit.sample(model, dit.RectifiedFlow(), noise, y, None, steps=2,
                      method="euler").shape == (2, 8, 8, 1)
    with pytest.raises(ValueError, match="at least 2 steps"):
        dit.GaussianDiffusion("1")
    # a safetensors file that `dit.py export` did not write
    foreign = tmp_path / "foreign.safetensors"
    with open(foreign, "wb") as f:
        dit.write_safetensors(f, {"w": np.zeros(2, np.float32)}, {"format": "pt"})
    with pytest.raises(ValueError, match="dit.py export"):
        dit.load_model(str(foreign))

#################################################################################
#                                                                               #
#            dit.py, PARTS II AND III: BEYOND THE PAPER, THE HARNESS            #
#                                                                               #
#################################################################################

#################################################################################
#                                Deferred masking                               #
#################################################################################

def masking_model(arch, depth=2):
    """A small DiTPlus of the architecture (RoPE on under DiT+) with random weights everywhere,
    adaLN and the final layer's included (their zero initialisation would hide what each token
    sees)."""
    cfg = dit.DiTConfig(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=depth,
                        num_heads=2, num_classes=3, learn_sigma=False, **dit.ARCHS[arch])
    graphdef, params = nnx.split(nnx.eval_shape(lambda: dit.DiTPlus(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: jnp.asarray(0.3 * rng.standard_normal(p.shape, np.float32)),
                          params)
    return nnx.merge(graphdef, params)

@pytest.mark.parametrize("arch", [pytest.param("dit", marks=slow), "dit+"])
def test_deferred_masking_on_every_patch_in_any_order_is_the_model(arch):
    """The masked forward pass given every patch, in a random order per image, computes what the
    model computes: the tokens are gathered and scattered back by their patch, and DiT+'s RoPE
    turns each by its own patch's position, not by its place in the sequence (without that, the
    test fails for DiT+)."""
    model = masking_model(arch)
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    t, y = jnp.array([100.0, 700.0]), jnp.array([0, 2])
    order = jnp.stack([jax.random.permutation(jax.random.key(i), 16) for i in range(2)])
    masked, hidden = model.forward(x, t, y, None, taps={1, 2}, keep=order, mix=1)
    np.testing.assert_allclose(masked, model(x, t, y), rtol=1e-5, atol=1e-5)
    assert hidden["block1"].shape == (2, 16, 32)  # the mixer's tokens, in the grid's order
    assert hidden["block2"].shape == (2, 16, 32)  # the backbone's, in the order kept

class LossRecorder:
    """An objective that keeps the model function and the mask that losses_at is given."""

    def draw(self, key, x0):
        return None, None

    def losses_at(self, model_fn, x0, t, noise, mask=None):
        self.model_fn, self.mask = model_fn, mask
        return {}

@slow
def test_deferred_masking_predicts_the_kept_patches_from_what_the_mixer_saw():
    """The mask of a step: the same number of whole patches in every image, a different set in each,
    from the step's key alone. The prediction is zero at the dropped patches; at the kept ones it
    depends on the dropped patches' input only through the mixer: without one (MaskDiT's input
    masking) not at all."""
    model = masking_model("dit+")
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    t, y = jnp.full(4, 500.0), jnp.arange(4) % 3

    def step(masking, key):  # (model function, mask) of a step
        recorder = LossRecorder()
        dit.TrainingLoss(masking)(recorder, model, x, y, key, None, None)
        return recorder.model_fn, recorder.mask

    masking = dit.DeferredMasking(0.75, 1)
    model_fn, mask = step(masking, jax.random.key(1))
    assert mask.shape == (4, 8, 8, 1)
    patches = np.asarray(mask[..., 0]).reshape(4, 4, 2, 4, 2).transpose(0, 1, 3, 2, 4)
    assert np.all(patches.min((-1, -2)) == patches.max((-1, -2)))  # whole patches
    kept = patches[..., 0, 0].reshape(4, 16)
    assert list(kept.sum(1)) == [masking.kept(16)] * 4 == [4] * 4
    assert len({tuple(k) for k in kept}) == 4
    np.testing.assert_array_equal(step(masking, jax.random.key(1))[1], mask)
    out = model_fn(x, t)
    assert np.all(np.asarray(out)[np.asarray(mask[..., 0]) == 0] == 0)
    # the input changed at the dropped patches only
    x2 = x + 5 * (1 - mask) * jax.random.normal(jax.random.key(2), x.shape)
    keep = np.asarray(mask[..., 0]) == 1
    assert not np.allclose(np.asarray(model_fn(x2, t))[keep], np.asarray(out)[keep], atol=1e-3)
    fn, mask0 = step(dit.DeferredMasking(0.75, 0), jax.random.key(1))
    np.testing.assert_array_equal(mask0, mask)
    np.testing.assert_allclose(fn(x2, t), fn(x, t), rtol=1e-5, atol=1e-6)

#################################################################################
#                  7b. Auxiliary losses on the model's own blocks               #
#################################################################################

def lever_model(depth=3, **overrides):
    """masking_model's random DiT+ (every weight away from adaLN-Zero's identity), with internal
    guidance's and SRA's heads."""
    cfg = dit.DiTConfig(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=depth,
                        num_heads=2, num_classes=3, learn_sigma=False, **dit.ARCHS["dit+"],
                        **{"internal_block": 1, "sra_head": True, **overrides})
    graphdef, params = nnx.split(nnx.eval_shape(lambda: dit.DiTPlus(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    return nnx.merge(graphdef, jax.tree.map(
        lambda p: jnp.asarray(0.3 * rng.standard_normal(p.shape, np.float32)), params))

def seen_of(hidden, **fields):
    """A Seen that holds `hidden` and `fields`, None elsewhere."""
    names = [f.name for f in dataclasses.fields(dit.Seen)]
    return dit.Seen(**{**dict.fromkeys(names), "mix": 0, "hidden": hidden, **fields})

@slow
def test_switches_off_train_as_the_core_step():
    """With no term and no masking, the harness's TrainingLoss is the core's batch_losses: two
    steps give the same state, bit for bit; forward's intermediates change nothing it predicts."""
    cfg = tiny_config("rf", "dit+", depth=2)
    tx, _ = dit.make_optimizer(1e-3)
    model = dit.DiTPlus(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.graphdef(model), dit.new_train_state(model, tx)
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 4))
    y = jnp.array([0, 1, 2, 0])
    ends = []
    for losses in (dit.batch_losses, dit.TrainingLoss()):
        step = jax.jit(dit.make_train_step(graphdef, dit.RectifiedFlow(), tx, 0.9, 0,
                                           batch_losses=losses))
        s = state
        for _ in range(2):
            s, metrics = step(s, x, y)
        assert "aux" not in metrics["losses"]
        ends.append(s)
    jax.tree.map(np.testing.assert_array_equal, *ends)
    t = jnp.array([10.0, 300.0, 600.0, 990.0])
    out, hidden = jax.jit(lambda: model.forward(x, t, y, taps={1, 2}))()
    np.testing.assert_array_equal(out, jax.jit(lambda: model(x, t, y))())
    assert set(hidden) == {"c", "block1", "block2"} and hidden["block1"].shape == (4, 16, 32)

def test_dispersive_loss_of_known_representations():
    """log mean_ij exp(-||z_i - z_j||^2 / (n tau)): 0 for identical samples; for two samples at
    squared distance d over n numbers, log((2 + 2 exp(-d / (n tau))) / 4); lower as they part."""
    term = dit.Dispersive(block=1, temperature=0.5)
    same = jnp.ones((4, 3, 2))  # (B, T, D): 4 identical samples of 6 numbers
    assert float(term(seen_of({"block1": same}))) == pytest.approx(0.0, abs=1e-7)
    z = jnp.stack([jnp.zeros((3, 2)), jnp.full((3, 2), 0.5)])  # d = 6 * 0.25 = 1.5, n = 6
    expected = np.log((2 + 2 * np.exp(-1.5 / (6 * 0.5))) / 4)
    assert float(term(seen_of({"block1": z}))) == pytest.approx(expected, rel=1e-6)
    assert float(term(seen_of({"block1": 3 * z}))) < expected

@slow
def test_sra_trains_the_student_through_its_head_never_the_teacher():
    """SRA's term is 1 - cos(head(student tokens), teacher tokens), per token: with the teacher's
    weights the model's own and no noise offset, its value from the blocks' outputs by hand. Its
    gradient reaches the student block, the blocks before it and the head; never a block after
    the student, the final layer, or the EMA weights it reads."""
    model = lever_model()
    graphdef, params = nnx.split(model, nnx.Param)
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    y, t = jnp.array([0, 1, 2, 0]), jnp.array([0.2, 0.4, 0.6, 0.8])
    noise = jax.random.normal(jax.random.key(1), x.shape)
    objective = dit.RectifiedFlow()

    @functools.partial(jax.jit, static_argnums=2)
    def term(params, ema, offset):
        model = nnx.merge(graphdef, params)
        teacher = nnx.merge(graphdef, ema)
        xt = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
        hidden = model.forward(xt, 1000 * t, y, taps={1})[1]
        seen = seen_of(hidden, objective=objective, model=model, teacher=teacher, x=x, y=y, t=t,
                       level=t, noise=noise, uniform=jax.random.uniform(jax.random.key(2), (4,)))
        return dit.SRA(student=1, teacher=2, offset=offset)(seen)

    xt = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    hidden = jax.jit(lambda: model.forward(xt, 1000 * t, y, taps={1, 2})[1])()
    a = np.asarray(jax.jit(model.sra_head)(hidden["block1"]))
    b = np.asarray(hidden["block2"])
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert float(term(params, params, 0.0)) == pytest.approx(np.mean(1 - cos), rel=1e-5)
    assert float(term(params, params, 0.2)) != pytest.approx(np.mean(1 - cos), rel=1e-3)
    grads, ema_grads = jax.jit(jax.grad(term, argnums=(0, 1)), static_argnums=2)(params, params,
                                                                                0.2)
    norms = {k: float(optax.tree.norm(v)) for k, v in nnx.to_pure_dict(grads).items()}
    blocks = {i: float(optax.tree.norm(v)) for i, v in nnx.to_pure_dict(grads)["blocks"].items()}
    assert blocks[0] > 0 and norms["sra_head"] > 0 and norms["x_embedder"] > 0
    assert blocks[1] == blocks[2] == norms["final_layer"] == norms["internal_head"] == 0
    assert float(optax.tree.norm(ema_grads)) == 0

@slow
def test_internal_guidance_extrapolates_from_the_internal_head():
    """Weight 1 samples as the plain model, bit for bit. One Euler step of rectified flow from t = 1
    is x - v: at weight w the velocity is internal + w * (final - internal), the internal head's
    from the tokens after its block; beside CFG each half is so guided before CFG mixes them. The
    internal head is trained by the objective's loss of its prediction."""
    model = lever_model(depth=2, sra_head=False)
    noise = jax.random.normal(jax.random.key(0), (3, 8, 8, 3))
    y, t = jnp.array([0, 1, 2]), jnp.full(3, 1000.0)
    # Compiled with LLVM's optimisations: without them, newer XLA rounds the two paths apart by more
    # than the tolerance below at these outputs.
    step = jax.jit(functools.partial(dit.sample, model, dit.RectifiedFlow(), noise, y, None,
                                     steps=1, method="euler"),
                   static_argnames=("cfg_scale", "internal_scale"), compiler_options=OPTIMISED)
    np.testing.assert_array_equal(step(internal_scale=1.0), step())
    forward = jax.jit(lambda x, t, y: model.forward(x, t, y), compiler_options=OPTIMISED)
    final, hidden = forward(noise, t, y)
    inner = hidden["internal"]
    # rounding, at outputs of up to 40 from these random weights
    close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-3)
    close(step(internal_scale=2.0), noise - (inner + 2.0 * (final - inner)))
    null = jnp.full_like(y, 3)
    final_u, hidden_u = forward(noise, t, null)
    cond, uncond = (i + 2.0 * (f - i) for f, i in ((final, inner), (final_u, hidden_u["internal"])))
    close(step(internal_scale=2.0, cfg_scale=1.5), noise - (uncond + 1.5 * (cond - uncond)))
    # its training term: the objective's loss with the internal head's prediction
    x = jax.random.normal(jax.random.key(1), noise.shape)
    level = jnp.array([0.3, 0.5, 0.9])
    xt = (1 - level[:, None, None, None]) * x + level[:, None, None, None] * noise
    hidden = forward(xt, 1000 * level, y)[1]
    seen = seen_of(hidden, objective=dit.RectifiedFlow(), x=x, t=level, noise=noise)
    expected = np.mean((np.asarray(noise - x - hidden["internal"])) ** 2)
    assert float(dit.Internal()(seen)) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(dit.InputError, match="no internal head; train it with"):
        dit.sample(lever_model(internal_block=0, sra_head=False), dit.RectifiedFlow(), noise, y,
                   None, steps=1, method="euler", internal_scale=2.0)

@dataclasses.dataclass(frozen=True)
class TokenEnergy:
    """A term of the test's own: the mean square of block 1's tokens."""
    weight: float = 0.1
    name = "token_energy"
    taps = frozenset({1})

    def __call__(self, seen):
        return jnp.mean(seen.hidden["block1"].astype(jnp.float32) ** 2)

@slow
def test_a_new_term_trains_and_is_logged_and_reported_with_no_other_change(tmp_path, monkeypatch):
    """A term written here, beside two of dit.py's: the metrics and `report` show each term,
    weighted, by its name, with nothing else to change."""
    cfg = tiny_config("rf", "dit+", depth=2, internal_block=1)
    mesh, (tx, schedule) = dit.make_mesh(), dit.make_optimizer(1e-3)
    graphdef, state, shardings = dit.init_state(cfg, tx, 0, mesh, False, jnp.float32, None)
    terms = (TokenEnergy(), dit.Internal(0.5), dit.Dispersive(2))
    step = dit.jit_train_step(graphdef, dit.RectifiedFlow(), tx, 0.9, False, 0, mesh, shardings,
                              terms=terms)
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 4))
    y = jnp.array([0, 1, 2, 0])
    run_dir = tmp_path / "run"
    os.makedirs(run_dir)
    (run_dir / "run.json").write_text(json.dumps({"terms": {"token_energy": {"weight": 0.1}}}))
    log = dit.MetricsLog(str(run_dir), 0, 4, schedule)
    for done in (1, 2):
        state, metrics = step(state, x, y)
        log.pending.append(metrics)
        record = log.flush(done)
    assert set(record["aux"]) == {"token_energy", "internal", "dispersive"}
    assert record["aux"]["token_energy"] > 0 and np.isfinite(list(record["aux"].values())).all()
    report = dit.main(["report", str(run_dir), "--out", str(tmp_path / "report")])
    axes = panels(report.figure)
    for name in record["aux"]:
        (line,) = axes[f"auxiliary term: {name} (weighted)"].lines
        np.testing.assert_array_equal(xy(line), [[1, 2], [r["aux"][name] for r in
                                                          records(run_dir)]])

def test_a_configuration_field_of_any_type_survives_a_weight_file(monkeypatch):
    """The configuration as a weight file's JSON metadata gives it back: the heads' fields, and
    fields of types that JSON changes (a tuple comes back a list) or that no field has yet."""
    @dataclasses.dataclass(frozen=True)
    class Config(dit.DiTConfig):
        window: tuple = (4, 4)
        label: str = "plain"
    monkeypatch.setattr(dit, "DiTConfig", Config)
    cfg = Config(**{**dataclasses.asdict(tiny_config("rf")), "internal_block": 0,
                    "sra_head": True, "window": (2, 8), "label": "wide"})
    meta = json.loads(json.dumps({"model": dataclasses.asdict(cfg), "objective": {"name": "rf"}}))
    model, objective = dit.model_of_metadata("file", meta, 10, jnp.float32)
    assert model.cfg == cfg and objective.name == "rf"
    meta["model"]["window"] = "2x8"
    with pytest.raises(dit.InputError, match="file: its metadata holds no DiT configuration"):
        dit.model_of_metadata("file", meta, 10, jnp.float32)
    meta["model"] |= {"window": [2, 8], "internal_block": 1}  # a head after the only block
    with pytest.raises(dit.InputError, match="no DiT has the configuration"):
        dit.model_of_metadata("file", meta, 10, jnp.float32)

# Every term at once, with remat and deferred masking (its backbone after block 0, so that each
# term reads kept tokens) up to step 4, then on every patch.
LEVERS = ["--arch", "dit+", "--dispersive", "--sra", "--internal-guidance", "--remat",
          "--mask-ratio", "0.5", "--mixer-depth", "0", "--unmask-at", "4"]

@pytest.fixture(scope="module")
def lever_run(tmp_path_factory, folder_data):
    """Six steps of LEVERS on one device, checkpoints at 3 and 6."""
    run_dir = tmp_path_factory.mktemp("levers") / "run"
    run_dit(run_dir.parent, train_args(folder_data, run_dir, 6, LEVERS))
    return run_dir

@slow
@pytest.mark.xdist_group("lever_run")
def test_every_lever_resumes_exactly_and_exports_without_its_training_head(tmp_path, folder_data,
                                                                           lever_run):
    """All three terms with remat and deferred masking: 3 steps, a kill, 3 resumed == 6 straight,
    bit for bit; each record logs each term. The run records its terms, and refuses to go on with
    another weight. The exported weights leave SRA's head out, keep the internal head, and sample
    with internal guidance."""
    resumed = tmp_path / "resumed"
    killed = run_dit(tmp_path, train_args(folder_data, resumed, 6, LEVERS),
                     patch=KILL_AFTER_CHECKPOINT, check=False)
    assert killed.returncode == 9
    out = run_dit(tmp_path, train_args(folder_data, resumed, 6, [*LEVERS, "--resume"]))
    assert "(1,904" not in out.stdout and "at sampling)" in out.stdout
    a, b = state_at(lever_run, 6), final_state(resumed)[1]
    assert any(k.startswith("params.sra_head.") for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert all(set(r["aux"]) == {"dispersive", "sra", "internal"}
               for r in records(resumed) if "loss" in r)
    settings = json.loads((resumed / "run.json").read_text())
    assert settings["terms"] == {"dispersive": {"block": 2, "weight": 0.5, "temperature": 1.0},
                                 "sra": {"student": 1, "teacher": 2, "offset": 0.2, "weight": 0.5},
                                 "internal": {"weight": 0.5}}
    assert settings["internal_block"] == 1
    out = run_dit(tmp_path, train_args(folder_data, resumed, 9,
                                       [*LEVERS, "--dispersive-weight", "0.25"]), check=False)
    assert out.returncode != 0 and "holds another run (terms:" in out.stderr
    exported = tmp_path / "ema.safetensors"
    dit.main(["export", "--ckpt", dit.list_checkpoints(resumed)[-1], "--out", str(exported)])
    tensors, raw = dit.read_safetensors(str(exported))
    assert not any("sra_head" in k for k in tensors) and "internal_head.linear.weight" in tensors
    assert json.loads(raw["model"])["sra_head"] is False
    model, _, _ = dit.load_model(str(exported))
    assert not hasattr(model, "sra_head")
    dit.main(["sample", "--ckpt", str(exported), "--n", "4", "--steps", "2",
              "--internal-scale", "1.5", "--out", str(tmp_path / "ig.png")])
    assert Image.open(tmp_path / "ig.png").size[0] > 16

@slow
@pytest.mark.xdist_group("lever_run")
def test_every_lever_on_two_hosts_of_four_devices_trains_as_one_device(tmp_path, folder_data,
                                                                       lever_run):
    """2 processes x 4 devices == 1 process x 1 device, with every term: the dispersive loss of
    the whole batch, and each sample's kept patches and SRA's teacher level, from the step's key."""
    run_dir = tmp_path / "multi"
    codes, outs = two_processes(tmp_path, [train_args(folder_data, run_dir, 3, LEVERS)] * 2,
                                devices=4)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "8 devices, 2 processes" in outs[0]
    # Adam's step of a gradient near zero magnifies the rounding of sums in another order
    assert_states_close(state_at(lever_run, 3), final_state(run_dir)[1], atol=2e-5)

#################################################################################
#                                8. Weight files                                #
#################################################################################

def test_config_is_inferred_from_official_sizes(reference):
    """Every field but the heads follows from the shapes of a state dict; the heads from the
    official size of that hidden width, so an unofficial width asks for a DiTConfig."""
    _, cfg, _ = reference
    state = dit.load_torch(fixture("dit_reference.pt"))
    p, C = cfg.patch_size, cfg.in_channels
    for size in dit.DIT_SIZES.values():
        D = size["hidden_size"]
        inferred = dit.infer_dit_config({**state, "x_embedder.proj.weight": np.zeros((D, C, p, p))})
        assert inferred == dataclasses.replace(cfg, hidden_size=D, num_heads=size["num_heads"],
                                               mlp_ratio=4.0, class_dropout_prob=0.1)
    unofficial = 1 + max(size["hidden_size"] for size in dit.DIT_SIZES.values())
    with pytest.raises(ValueError, match="pass a DiTConfig"):
        dit.infer_dit_config({**state, "x_embedder.proj.weight": np.zeros((unofficial, C, p, p))})

def test_wrong_size_checkpoint_is_refused(reference):
    _, cfg, _ = reference
    with pytest.raises(ValueError, match="another model size"):
        dit.load_dit_checkpoint(fixture("dit_reference.pt"),
                                dataclasses.replace(cfg, mlp_ratio=2.0))
    with pytest.raises(ValueError, match="missing keys .* another model size"):
        dit.load_dit_checkpoint(fixture("dit_reference.pt"),
                                dataclasses.replace(cfg, depth=cfg.depth + 1))

def test_checkpoint_loader_refuses_code(tmp_path):
    """A .pt whose pickle would call os.system is refused by name, and the command never runs."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", pickle.dumps({"x_embedder.proj.weight": RunsCommand(marker)},
                                                 protocol=2))
    with pytest.raises(UnsafePickleError, match="system"):
        dit.load_dit_checkpoint(str(path))
    assert not marker.exists()

def test_safetensors_dtypes_and_truncation(tmp_path):
    """Hand-built file: the header layout of the safetensors spec, F16/BF16/I64 data; truncation ->
    clear error."""
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    bf16 = (f32.view(np.uint32) >> 16).astype("<u2")  # these values are exact in bfloat16
    parts = {"a": ("F16", f32.astype("<f2")), "b": ("BF16", bf16),
             "c": ("I64", np.array([7, -1], "<i8"))}
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, (dt, arr) in parts.items():
        header[name] = {"dtype": dt, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        blobs.append(arr.tobytes())
    head = json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    got, metadata = read_safetensors(str(path))
    assert metadata == {"format": "pt"}
    np.testing.assert_array_equal(got["a"], f32)
    np.testing.assert_array_equal(got["b"], f32)
    assert got["b"].dtype == np.float32
    np.testing.assert_array_equal(got["c"], [7, -1])

    real = open(os.path.join(fixture("vae_reference"), "diffusion_pytorch_model.safetensors"),
                "rb").read()
    for name, blob in [("cut.safetensors", real[:len(real) // 2]), ("short.safetensors", real[:5]),
                       ("head.safetensors", real[:200]),
                       ("text.safetensors", b"<html>not found</html>")]:
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ValueError, match="not a readable safetensors file"):
            read_safetensors(str(tmp_path / name))
    shutil.copy(os.path.join(fixture("vae_reference"), "config.json"), tmp_path / "config.json")
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(real[:len(real) - 10])
    with pytest.raises(ValueError, match="incomplete"):
        load_vae(str(tmp_path))

#################################################################################
#                               9. The autoencoder                              #
#################################################################################

@slow
def test_vae_matches_diffusers():
    """Posterior mean, log-variance and decode(mean) of the small random VAE equal diffusers'
    (README: 1e-5)."""
    ref = np.load(fixture("vae_reference.npz"))
    vae = load_vae(fixture("vae_reference"))
    assert vae.cfg == VAEConfig.from_json(os.path.join(fixture("vae_reference"), "config.json"))
    mean, logvar = vae.encode(nhwc(ref["x"]))
    assert mean.shape == nhwc(ref["mean"]).shape
    assert rel_err(mean, nhwc(ref["mean"])) < 1e-5
    assert rel_err(logvar, nhwc(ref["logvar"])) < 1e-5
    assert rel_err(vae.decode(nhwc(ref["mean"])), nhwc(ref["decoded"])) < 1e-5

def products(fn, *args):
    """(name, precision, input dtype) of every dot_general and conv_general_dilated that fn(*args)
    traces, in nested jaxprs too; args may be jax.ShapeDtypeStructs."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                found.append((eqn.primitive.name, eqn.params["precision"],
                              eqn.invars[0].aval.dtype))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else [param]:
                    if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                        walk(getattr(sub, "jaxpr", sub))
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found

def convs_and_linears(module):
    return [type(m) for _, m in nnx.iter_graph(module) if isinstance(m, (nnx.Conv, nnx.Linear))]

def test_float32_vae_multiplies_in_float32_on_every_backend():
    """A float32 VAE asks XLA for HIGHEST precision in every product (else TF32 on NVIDIA GPUs,
    one bfloat16 pass on TPUs); a bfloat16 one computes in bfloat16 at the default precision."""
    highest = (jax.lax.Precision.HIGHEST,) * 2
    cfg = VAEConfig(block_out_channels=(32, 64), norm_num_groups=16)  # every kind of layer
    z = jax.ShapeDtypeStruct((1, 4, 4, 4), jnp.float32)  # (B, h, w, latent)
    x = jax.ShapeDtypeStruct((1, 8, 8, 3), jnp.float32)  # (B, H, W, 3)
    for dtype in (jnp.float32, jnp.bfloat16):
        graphdef, state = nnx.split(nnx.eval_shape(
            lambda: AutoencoderKL(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
        vae = nnx.merge(graphdef, state)
        decode = products(lambda s, z: nnx.merge(graphdef, s).decode(z), state, z)
        encode = products(lambda s, x: nnx.merge(graphdef, s).encode(x), state, x)
        # every conv and linear layer, post_quant_conv or quant_conv, the attention's 2 products
        assert len(decode) == len(convs_and_linears(vae.decoder)) + 1 + 2
        assert len(encode) == len(convs_and_linears(vae.encoder)) + 1 + 2
        if dtype == jnp.float32:
            assert all(p == highest for _, p, _ in decode + encode), decode + encode
        else:
            assert all(p is None and t == jnp.bfloat16 for _, p, t in decode + encode), decode

@slow
def test_bfloat16_vae_decodes_close_to_float32():
    ref = np.load(fixture("vae_reference.npz"))
    decode = nnx.jit(lambda vae, z: vae.decode(z))
    exact = decode(load_vae(fixture("vae_reference")), nhwc(ref["mean"]))
    half = decode(load_vae(fixture("vae_reference"), dtype=jnp.bfloat16), nhwc(ref["mean"]))
    assert half.dtype == jnp.float32  # the outputs stay float32
    # measured 2.0e-2 on this random-weight VAE; bfloat16 keeps 8 bits of mantissa
    assert 1e-3 < rel_err(half, exact) < 5e-2

@slow
def test_vae_full_size_keys_and_shapes():
    """The default (SD kl-f8) configuration has exactly the parameters of the released VAE, as named
    by diffusers."""
    vae = dit.abstract_module(AutoencoderKL, VAEConfig())
    params = dit.named_params(vae)
    ours = {key: list(dit.to_torch_layout(name, np.empty(params[name].shape, np.int8)).shape)
            for key, name in vae_torch_names(vae).items()}
    with open(fixture("sd_vae_keys.json")) as f:
        ref = json.load(f)
    assert sorted(set(ours) ^ set(ref)) == []
    assert ours == ref
    n_params = sum(int(np.prod(v.shape)) for _, v in nnx.iter_graph(vae)
                   if isinstance(v, nnx.Param))
    assert n_params == sum(int(np.prod(s)) for s in ref.values())

def test_vae_old_attention_names_load():
    """Older checkpoints name the attention query/key/value/proj_attn and may store them as 1x1
    convs."""
    folder = fixture("vae_reference")
    new, _ = read_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
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
    vae = load_vae_weights(dit.abstract_module(AutoencoderKL, cfg), old)
    ref = np.load(fixture("vae_reference.npz"))
    assert rel_err(vae.encode(nhwc(ref["x"]))[0], nhwc(ref["mean"])) < 1e-5

def test_vae_key_mismatch_is_named():
    folder = fixture("vae_reference")
    tensors, _ = read_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    cfg = VAEConfig.from_json(os.path.join(folder, "config.json"))
    tensors["encoder.extra.weight"] = tensors.pop("decoder.conv_out.bias")
    named = (r"missing keys 1 \['decoder\.conv_out\.bias'\], "
             r"unexpected keys 1 \['encoder\.extra\.weight'\]")
    with pytest.raises(ValueError, match=named):
        load_vae_weights(dit.abstract_module(AutoencoderKL, cfg), tensors)

def test_load_vae_bad_sources(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError,
                       match="neither diffusion_pytorch_model.safetensors nor .bin"):
        load_vae(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not 'ema', 'mse'"):
        load_vae(str(tmp_path / "nope.safetensors"))

    def offline(url, timeout=None):
        raise OSError("network is unreachable")
    monkeypatch.setattr("urllib.request.urlopen", offline)
    with pytest.raises(dit.InputError, match="by hand into"):
        load_vae("ema", cache_dir=str(tmp_path / "cache"))
    assert not any(".tmp" in p.name or p.is_file() for p in (tmp_path / "cache").rglob("*"))

def test_load_vae_ema_downloads_into_cache(tmp_path, monkeypatch):
    """"ema" fetches config.json and the safetensors file once (here served from the fixture), then
    reads the cache."""
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
    assert sorted(os.listdir(tmp_path / "sd-vae-ft-ema")) == ["config.json",
                                                              "diffusion_pytorch_model.safetensors"]

def test_load_vae_bin_goes_through_torch_reader(tmp_path):
    """A .bin state dict is read with dit.load_torch; one of the wrong model (DiT's) is refused by
    key names."""
    shutil.copy(os.path.join(fixture("vae_reference"), "config.json"), tmp_path / "config.json")
    shutil.copy(fixture("dit_reference.pt"), tmp_path / "diffusion_pytorch_model.bin")
    named = r"missing keys \d+ \['decoder\.conv_in\.bias'.*unexpected keys \d+ \['blocks\.0\."
    with pytest.raises(ValueError, match=named):
        load_vae(str(tmp_path))

def test_vae_config_from_json(tmp_path):
    cfg = VAEConfig.from_json(os.path.join(fixture("vae_reference"), "config.json"))
    raw = json.load(open(os.path.join(fixture("vae_reference"), "config.json")))
    for field in dataclasses.fields(VAEConfig):
        want = raw.get(field.name, field.default)
        assert getattr(cfg, field.name) == (tuple(want) if isinstance(want, list)
                                            else want), field.name
    (tmp_path / "c.json").write_text(json.dumps({**raw,
                                                 "up_block_types": ["AttnUpDecoderBlock2D"] * 2}))
    with pytest.raises(ValueError, match="up_block_types"):
        VAEConfig.from_json(str(tmp_path / "c.json"))

def test_vae_rejects_nchw():
    vae = load_vae(fixture("vae_reference"))
    with pytest.raises(ValueError, match="NHWC"):
        vae.encode(np.zeros((1, 3, 16, 16), np.float32))

#################################################################################
#                                    10. Data                                   #
#################################################################################

def write_idx(path, arr, gz=False):
    """An IDX file as the format's description defines it: 00 00, type code, ndim, big-endian dims,
    data."""
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C}
    raw = bytes([0, 0, codes[arr.dtype], arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    raw += arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(raw) if gz else raw)

def test_mnist_real_test_digits(capsys):
    ds = load_dataset("mnist", data("mnist"))
    assert "test set" in capsys.readouterr().out  # only t10k is there: the one-line note
    n = len(ds.x)
    assert ds.x.shape == (n, 28, 28, 1) and ds.x.dtype == np.uint8 and len(ds.labels) == n
    assert ds.input_shape == (28, 28, 1) and not ds.is_latent and not ds.flip
    assert ds.labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]  # the test set's first digits
    if n == 10000:  # the published class counts of the whole MNIST test set
        assert np.bincount(ds.labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974,
                                                   1009]
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
    assert not any(".tmp" in p.name for p in (tmp_path / "mnist").iterdir())

class FakeResponse(io.BytesIO):
    headers = {}

def test_download_verifies_checksum(tmp_path, monkeypatch):
    payload = os.urandom(3000)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: FakeResponse(payload))
    path = tmp_path / "sub" / "file.bin"
    dit.download("https://example.invalid/file.bin", str(path), hashlib.md5(payload).hexdigest(),
                 "md5")
    assert path.read_bytes() == payload
    bad = tmp_path / "bad.bin"
    with pytest.raises(ValueError, match="corrupted"):
        dit.download("https://example.invalid/file.bin", str(bad), "0" * 32, "md5")
    # neither the file nor a partial one is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]

class Py2Pickler(pickle._Pickler):
    """Writes pickles as Python 2's cPickle wrote CIFAR-10's: every string is a byte string
    (BINSTRING) and arrays are rebuilt through numpy.core.multiarray._reconstruct, numpy 1's module
    name."""
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
    """Five tiny training batches and batches.meta in the official layout, and the NHWC images they
    encode."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (5 * n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 5 * n)
    files = {}
    for b in range(5):
        chunk = images[b * n:(b + 1) * n]
        # each row: the 1024 red values, then green, then blue, each in row-major order
        rows = np.stack([np.concatenate([img[:, :, c].reshape(-1) for c in range(3)])
                         for img in chunk])
        files[f"data_batch_{b + 1}"] = py2_pickle({"batch_label": f"training batch {b + 1} of 5",
                                                   "data": rows,
                                                   "labels": [int(v)
                                                              for v in labels[b * n:(b + 1) * n]],
                                                   "filenames": [f"img_{i}.png" for i in range(n)]})
    files["batches.meta"] = py2_pickle({"label_names": CLASSES, "num_cases_per_batch": n,
                                        "num_vis": 3072})
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
    assert (ds.class_names == CLASSES and ds.num_classes == 10 and ds.flip
            and ds.input_shape == (32, 32, 3))

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

def test_cifar_refuses_code_in_pickle(tmp_path):
    files, _, _ = cifar_files()
    marker = tmp_path / "it_ran"
    files["data_batch_3"] = py2_pickle({"data": RunsCommand(marker)})
    write_cifar_archive(tmp_path / "cifar-10-python.tar.gz", files)
    with pytest.raises(UnsafePickleError, match="data_batch_3: .*system"):
        load_dataset("cifar10", str(tmp_path))
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

def test_center_crop_arr_against_manual_adm_steps():
    """ADM's recipe done by hand: BOX-halve 1000x600 while the short side is >= 2*64, bicubic,
    centre crop."""
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (600, 1000, 3), dtype=np.uint8))
    out = center_crop_arr(img, 64)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    # 600 -> 300 -> 150 -> 75 (75 < 128 stops), then bicubic to short side 64:
    # (1000/8=125) * 64/75 = 106.67 -> 107
    ref = (img.resize((500, 300), Image.BOX).resize((250, 150), Image.BOX)
           .resize((125, 75), Image.BOX))
    ref = np.asarray(ref.resize((107, 64), Image.BICUBIC))[:, (107 - 64) // 2:(107 - 64) // 2 + 64]
    np.testing.assert_array_equal(out, ref)
    # grayscale and palette images come back as RGB
    assert center_crop_arr(img.convert("L"), 32).shape == (32, 32, 3)
    assert center_crop_arr(img.convert("P"), 32).shape == (32, 32, 3)

def real_jpegs(out, per_class=3, classes=2):
    """Extract the first few CIFAR-10 JPEGs of the first classes met in the shared archive (in
    archive order, so only its beginning is decompressed). Returns {class: [paths]}."""
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
    np.testing.assert_array_equal(ds.labels, [names.index(os.path.basename(os.path.dirname(p)))
                                              for p in files])
    np.testing.assert_array_equal(ds.x, np.stack([np.asarray(Image.open(p).convert("RGB"))
                                                  for p in files]))
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
    expected = np.stack([np.asarray(Image.open(flat / os.path.basename(p)).convert("RGB"))
                         for p in files])
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

def test_image_files_is_the_one_rule_of_the_three_files(tmp_path):
    """dit.py's folder dataset, fid.py's folders and prepare_imagenet100.py's class folders see
    the same images: any-case image extensions at any depth, hidden names skipped."""
    for name in ("a/x.PNG", "a/deep/y.jpg", "a/.hidden.png", "a/.ipynb_checkpoints/z.png",
                 "a/notes.txt", "b/w.jpeg", "loose.png", ".git/q.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / name, format="PNG")
    want = {"a": ["a/deep/y.jpg", "a/x.PNG"], "b": ["b/w.jpeg"]}
    loose, subfolders = dit.image_files(str(tmp_path))
    assert loose == [str(tmp_path / "loose.png")]
    assert subfolders == {k: [str(tmp_path / p) for p in v] for k, v in want.items()}
    classes, files, labels, _ = prepare_imagenet100.find_images(str(tmp_path), "train")
    assert classes == ["a", "b"] and files == want["a"] + want["b"]
    assert labels.tolist() == [0, 0, 1]
    assert fid.load_images(str(tmp_path)).paths == [
        str(tmp_path / p) for p in want["a"] + want["b"] + ["loose.png"]]
    with pytest.warns(UserWarning, match="1 images directly"):
        ds = load_dataset("folder", str(tmp_path))
    assert ds.labels.tolist() == [0, 0, 1] and ds.class_names == ["a", "b"]

def write_prepared(out, n=12, h=2, w=3, c=4, pixels=None, seed=0):
    """A prepare_imagenet100.py output folder written by hand. Latents: mean and std of the image
    and of its flip are kept apart (flip means are negative, image means positive) so a test can
    tell which was used."""
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
    latents = np.lib.format.open_memmap(os.path.join(out, "latents.npy"), "w+", np.float16,
                                        (n, 2, h, w, 2 * c))
    latents[:] = np.concatenate([mean, std], axis=-1)
    latents.flush()
    return np.array(latents), labels

def test_imagenet100_latents(tmp_path):
    latents, labels = write_prepared(str(tmp_path))
    ds = load_dataset("imagenet100", str(tmp_path))
    assert (isinstance(ds.x, np.memmap) and ds.is_latent
            and ds.latent_scale == pytest.approx(0.18215))
    assert ds.input_shape == (2, 3, 4) and ds.class_names == ["class 0", "class 1", "class 2"]
    n, c, G, seed = len(latents), 4, 6, 11
    loader = Loader(ds, G, seed)
    chose = set()
    for step in range(4):
        # the recipe: epoch permutation from (seed, epoch); [image, flip] choice and eps from
        # (seed, step, 1)
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
        # image means are positive and flip means negative (std at most a quarter of |mean|): the
        # sign of each sample's average tells which one was taken
        np.testing.assert_array_equal(x.mean(axis=(1, 2, 3)) < 0, which == 1)
        chose |= set(which.tolist())
        # two processes draw the same global noise and flips and take their halves of it
        halves = [Loader(ds, G, seed, process_index=i, process_count=2).batch(step)[0]
                  for i in range(2)]
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

def numbered(n, flip=False, classes=5):
    """Pixel dataset whose image i holds 4*i + column, so a batch tells which samples it holds (and
    flips show)."""
    assert n <= 64
    x = (4 * np.arange(n)[:, None, None, None] + np.arange(4)[None, None, :, None]).astype(np.uint8)
    x = np.broadcast_to(x, (n, 4, 4, 1)).copy()  # (N, H, W, 1)
    return Dataset("numbered", x, np.arange(n) % classes, classes, [str(i) for i in range(classes)],
                   flip=flip)

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

def test_held_out_samples_are_fixed_and_never_trained_on():
    train, held = dit.hold_out(60, 10)
    again, same = dit.hold_out(60, 10)
    np.testing.assert_array_equal(held, same)  # the same for every run: no seed involved
    np.testing.assert_array_equal(train, again)
    assert len(held) == 10 and sorted(np.concatenate([train, held]).tolist()) == list(range(60))
    loader = Loader(numbered(60), 10, seed=3, subset=train)
    seen = np.concatenate([loader.indices(step) for step in range(10)])  # two epochs of 5 batches
    assert not set(seen.tolist()) & set(held.tolist())
    assert sorted(seen[:50].tolist()) == sorted(train.tolist())
    x, _ = loader.batch(0)
    np.testing.assert_array_equal(sample_ids(x), loader.indices(0))
    assert len(dit.hold_out(60, 0)[1]) == 0 and len(dit.hold_out(60, 0)[0]) == 60

def test_loader_rejects_bad_arguments():
    ds = numbered(10)
    with pytest.raises(ValueError, match="number of training samples"):
        Loader(ds, 11, seed=0)
    with pytest.raises(ValueError, match="multiple of 3"):
        Loader(ds, 8, seed=0, process_count=3)
    with pytest.raises(ValueError, match="does not exist"):
        Loader(ds, 8, seed=0, process_index=2, process_count=2)

#################################################################################
#                                11. Checkpoints                                #
#################################################################################

# Stops the process dead (no cleanup, like SIGKILL) right after the checkpoint of step 3 is written.
KILL_AFTER_CHECKPOINT = """
save = dit.save_checkpoint
def save_then_die(run_dir, state, *args):
    save(run_dir, state, *args)
    if int(state["step"]) == 3:
        os._exit(9)
dit.save_checkpoint = save_then_die
"""

# Kills the process in the middle of writing the checkpoint of step 6: half of it is on disk.
KILL_WHILE_WRITING = """
import shlex
import signal
import numpy as np
import optax
savez = np.savez
def savez_and_die(f, **arrays):
    if int(arrays["step"]) == 6:
        f.write(b"PK\\x03\\x04" + bytes(1000))
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    savez(f, **arrays)
np.savez = savez_and_die
"""

@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, folder_data):
    """Nine uninterrupted training steps on one device, with checkpoints at steps 3, 6 and 9 and
    validation losses at the same steps: what the tests of resuming, devices and hosts compare
    with (all with VALIDATION, which holds samples out of the training set)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_dit(run_dir.parent, train_args(folder_data, run_dir, 9, VALIDATION))
    return run_dir

VALIDATION = ["--val-images", "8", "--val-every", "3"]

def state_at(run_dir, step):
    return dit.read_checkpoint(os.path.join(run_dir, "checkpoints", f"step_{step:07d}.npz"))[1]

def records(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]

@slow
@pytest.mark.xdist_group("straight_run")
def test_resume_is_exact_after_kill(tmp_path, folder_data, straight_run):
    """6 uninterrupted steps == 3 steps, a kill, 3 resumed steps, bit for bit."""
    killed = run_dit(tmp_path, train_args(folder_data, tmp_path / "resumed", 6,
                                          [*VALIDATION, "--keep", "1"]),
                     patch=KILL_AFTER_CHECKPOINT, check=False)
    assert killed.returncode == 9
    assert ([os.path.basename(p) for p in dit.list_checkpoints(tmp_path / "resumed")]
            == ["step_0000003.npz"])
    # A run killed later than its checkpoint has logged steps that the resumed run does again, and
    # may have left a line half-written.
    with open(tmp_path / "resumed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.5}\n{"step": 5, "lo')
    out = run_dit(tmp_path, train_args(folder_data, tmp_path / "resumed", 6,
                                       [*VALIDATION, "--resume", "--keep", "1"]))
    assert "resumed" in out.stdout
    a, b = state_at(straight_run, 6), final_state(tmp_path / "resumed")[1]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # The EMA at --keep-ema's steps (by default --ckpt-every's 3 times 1, 2, 4, ...: 3 and 6),
    # autoguidance's guides, outlives the rotation of --keep 1 and the resume, as uninterrupted.
    assert dit.list_checkpoints(tmp_path / "resumed") == [
        str(tmp_path / "resumed" / "checkpoints" / "step_0000006.npz")]
    kept = ["step_0000003.safetensors", "step_0000006.safetensors"]
    assert sorted(os.listdir(tmp_path / "resumed" / "ema")) == kept
    for name in kept:
        ours, theirs = (dit.read_safetensors(str(run / "ema" / name))[0]
                        for run in (tmp_path / "resumed", straight_run))
        assert ours.keys() == theirs.keys()
        for k in ours:
            np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    # the log holds each step once, and the validation losses (fixed held-out samples, fixed
    # noise) of the resumed run are those of the uninterrupted one
    resumed = records(tmp_path / "resumed")
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert all(set(r["loss_t"]) == {"0.00-0.25", "0.25-0.50", "0.50-0.75", "0.75-1.00"}
               for r in resumed if "loss" in r)
    validation = [r for r in resumed if "val_loss" in r]
    assert [r["step"] for r in validation] == [3, 6]
    assert validation == [r for r in records(straight_run) if "val_loss" in r][:2]
    assert set(validation[0]["val_loss_t"]) == {f"{t:g}" for t in dit.VAL_TIMES}
    # --resume FILE continues another run's checkpoint in a new run directory, exactly again; within
    # its own run, going back behind newer checkpoints is refused (a later resume would jump to
    # them)
    step3 = str(straight_run / "checkpoints" / "step_0000003.npz")
    out = run_dit(tmp_path, train_args(folder_data, straight_run, 9,
                                       [*VALIDATION, "--resume", step3]), check=False)
    assert out.returncode != 0 and "holds newer checkpoints (step_0000009.npz)" in out.stderr
    out = run_dit(tmp_path, train_args(folder_data, tmp_path / "branch", 6,
                                       [*VALIDATION, "--resume", step3]))
    assert "resumed" in out.stdout and "step_0000003.npz" in out.stdout
    c = final_state(tmp_path / "branch")[1]
    for k in a:
        np.testing.assert_array_equal(a[k], c[k], err_msg=k)
    # with the other run's records up to step 3 (test_a_run_goes_on_from_a_read_only_copy...)
    assert [r["step"] for r in records(tmp_path / "branch") if "loss" in r] == [1, 2, 3, 4, 5, 6]

@slow
@pytest.mark.xdist_group("straight_run")
def test_a_run_goes_on_from_a_read_only_copy_with_its_history(tmp_path, folder_data,
                                                               straight_run):
    """The way from one Kaggle version to the next: a run's folder as the next version mounts it
    (copied, read-only), and a new --run-dir that goes on from its checkpoint of step 3. The new run
    begins with the old run's history up to step 3 (records, grids, kept EMA weights; none of the
    later steps'), and a record that names it, says so in one line, reads the copy only, resumes
    itself as any run, and ends bit for bit as the uninterrupted run, whose records `report` then
    reads whole. Under a notebook platform's variables, and there only, the run is told what the
    session's end would take."""
    copy, new = tmp_path / "input" / "old", tmp_path / "new"
    shutil.copytree(straight_run, copy)
    for folder, step in itertools.product(("samples", "ema"), (3, 6)):  # grids and EMA weights
        name = f"step_{step:07d}.{'png' if folder == 'samples' else 'safetensors'}"
        os.makedirs(copy / folder, exist_ok=True)
        (copy / folder / name).write_bytes(f"{folder} {step}".encode())
    subprocess.run(["chmod", "-R", "a-w", str(copy)], check=True)  # root writes even so: compared
    listing = lambda: {(str(p), p.stat().st_mtime_ns, p.stat().st_mode,  # noqa: E731
                        p.read_bytes() if p.is_file() else None) for p in copy.rglob("*")}
    before = listing()
    step3 = copy / "checkpoints" / "step_0000003.npz"
    continued = run_dit(tmp_path, train_args(folder_data, new, 6, [
        *VALIDATION, "--resume", str(step3), "--time-limit", "13h"]),
        env={"KAGGLE_KERNEL_RUN_TYPE": "Batch"})  # a saved version, on a CPU: 12 h
    resumed = run_dit(tmp_path, train_args(folder_data, new, 9, VALIDATION))
    assert listing() == before
    subprocess.run(["chmod", "-R", "u+w", str(copy)], check=True)
    assert (f"continues {copy} at step 3: its metrics, grids and kept EMA weights up to there "
            f"copied (files: 1 in samples/, 1 in ema/)") in continued.stdout.splitlines()
    assert [line for line in continued.stdout.splitlines() if line.startswith("note:")] == [
        f"note: Kaggle deletes {new} when this session ends, unless it lies in /kaggle/working "
        f"and is kept: as a saved version's output (Save & Run All), or by the notebook's "
        f"Persistence setting (files; set before the session ends) (README, Notebooks)",
        "note: --time-limit 13 h outlasts a Kaggle session here (12 h), whose end would come "
        "before the run's checkpoint: give it less (README, Notebooks)"]
    assert "note:" not in resumed.stdout and "continues" not in resumed.stdout
    assert f"resumed {new / 'checkpoints' / 'step_0000006.npz'}" in resumed.stdout
    for name, value in state_at(straight_run, 9).items():
        np.testing.assert_array_equal(state_at(new, 9)[name], value, err_msg=name)
    history = records(new)
    assert {"step": 3, "continues": str(copy)} in history
    assert [r["step"] for r in history if "loss" in r] == list(range(1, 10))
    assert ([r for r in history if "val_loss" in r]
            == [r for r in records(straight_run) if "val_loss" in r])
    assert [r["step"] for r in dit.RunRecords(str(new)).train] == list(range(1, 10))
    # step 3's copied, 6's and 9's drawn by the new run's ends (--steps 6, then 9)
    assert sorted(os.listdir(new / "samples")) == [f"step_{s:07d}.png" for s in (3, 6, 9)]
    assert (new / "samples" / "step_0000003.png").read_bytes() == b"samples 3"
    # step 3's EMA copied, step 6's kept by the new run itself (--keep-ema), as the uninterrupted
    # run kept it
    assert sorted(os.listdir(new / "ema")) == [f"step_{s:07d}.safetensors" for s in (3, 6)]
    assert (new / "ema" / "step_0000003.safetensors").read_bytes() == b"ema 3"
    assert ((new / "ema" / "step_0000006.safetensors").read_bytes()
            == (straight_run / "ema" / "step_0000006.safetensors").read_bytes())

@pytest.mark.parametrize("environ, run_dir, platform, time_limit, says", [
    ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "/kaggle/working/runs/r", "tpu", "8h30m",
     ["Kaggle deletes"]),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, "/kaggle/working/runs/r", "tpu", "8h30m", []),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, "/kaggle/temp/r", "gpu", "11h30m", ["Kaggle deletes"]),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, "/kaggle/working/r", "tpu", "11h30m",
     ["--time-limit 11.5 h outlasts a Kaggle session here (9 h)"]),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, "/kaggle/working/r", "gpu", "11h30m", []),
    ({"COLAB_RELEASE_TAG": "release-colab-1"}, "/content/runs/r", "tpu", None, ["Colab deletes"]),
    ({"COLAB_GPU": "1"}, "/content/drive/MyDrive/r", "gpu", "13h",
     ["--time-limit 13 h outlasts a Colab session here (12 h)"]),
    ({"COLAB_RELEASE_TAG": "release-colab-1"}, "/content/drive/MyDrive/r", "tpu", "11h", []),
    ({}, "/kaggle/temp/r", "tpu", "100h", []),
    ({"HOME": "/content"}, "runs/r", "cpu", "100h", []),
])
def test_notebook_platforms_tell_what_their_session_keeps(environ, run_dir, platform, time_limit,
                                                          says):
    """A run on Kaggle or Colab hears, in one line each, that the session's end deletes its run
    directory, and that its --time-limit outlasts the session; elsewhere nothing."""
    seconds = time_limit and dit.duration(time_limit)
    notes = dit.session_notes(run_dir, seconds, platform, environ)
    assert len(notes) == len(says) and all(n.startswith("note: " + s) for n, s in zip(notes, says))
    assert all(n.endswith("(README, Notebooks)") and "\n" not in n for n in notes)

def small_state(step):
    """A training state of 1 MB (250,000 float32 numbers) at `step`."""
    return {"step": jnp.int32(step), "params": {"w": jnp.full((500, 500), step, jnp.float32)}}

def read_only_open(file, mode="r", *args, **kwargs):
    """open() in a folder on a read-only filesystem (Kaggle's /kaggle/input, a mounted archive): a
    root user is refused it too, unlike a folder without write permission."""
    if set(mode) & set("wax+"):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), file)
    return open(file, mode, *args, **kwargs)

def test_checkpoint_that_cannot_be_written_stops_in_one_line_and_keeps_the_one_before(
        tmp_path, folder_data, monkeypatch):
    """A disk that fills during the write, one that has too little space before it, a read-only
    folder: each ends the run with an InputError (one line on the command line) that names the
    folder, the space a checkpoint needs and the checkpoint the same command continues from; the
    checkpoint before stays whole and no partial file is left. A run directory that cannot be
    written is refused at the start."""
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints"
    dit.save_checkpoint(str(run_dir), small_state(3), {}, keep=3)

    def savez_until_full(f, **arrays):
        f.write(b"PK\x03\x04" + bytes(1000))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    full_disk = [(np, "savez", savez_until_full)]
    little_space = [(shutil, "disk_usage", lambda path: types.SimpleNamespace(free=500_000))]
    read_only = [(dit, "open", read_only_open)]
    for patches, why in [(full_disk, os.strerror(errno.ENOSPC)),
                         (little_space, r"not enough space\): it needs 1\.0 MB, 0\.5 MB free"),
                         (read_only, os.strerror(errno.EROFS))]:
        with monkeypatch.context() as m:
            for module, name, value in patches:
                m.setattr(module, name, value, raising=False)
            with pytest.raises(dit.InputError) as info:
                dit.save_checkpoint(str(run_dir), small_state(6), {}, keep=3)
        message = str(info.value)
        assert re.match(f"cannot write the checkpoint of step 6 in {re.escape(str(folder))} "
                        f"\\({why}", message), message
        assert "it needs 1.0 MB" in message and "continue from step_0000003.npz" in message
        assert "\n" not in message
        assert os.listdir(folder) == ["step_0000003.npz"]
        meta, arrays = dit.read_checkpoint(str(folder / "step_0000003.npz"))
        assert meta == {"step": 3} and (arrays["params.w"] == 3).all()
    monkeypatch.setattr(dit, "open", read_only_open, raising=False)
    with pytest.raises(dit.InputError, match=f"cannot write in {re.escape(str(tmp_path / 'new'))} "
                       f"\\({os.strerror(errno.EROFS)}\\)"):
        dit.main(train_args(folder_data, tmp_path / "new", 2))

#################################################################################
#                             12. The training loop                             #
#################################################################################

# Steps of K = 1, 2 and 4 micro-batches on this process's devices, with deferred masking and two
# terms, without and with float16's loss scaling (on a float32 model: the CPU has no float16 matrix
# products): each K's two steps must end where K = 1's do.
ACCUMULATION = """
import sys, jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, {here!r})
import dit
from jax.sharding import NamedSharding, PartitionSpec as P
cfg = dit.DiTConfig(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=2,
                    num_heads=2, num_classes=3, learn_sigma=False, **dit.ARCHS["dit+"],
                    internal_block=1, sra_head=True)
mesh, (tx, _) = dit.make_mesh(), dit.make_optimizer(1e-3)
split, B = NamedSharding(mesh, P("data")), 8 * jax.device_count()
x = jax.device_put(jax.random.normal(jax.random.key(1), (B, 8, 8, 3)), split)
y = jax.device_put(jnp.arange(B) % 3, split)
masking, terms = dit.DeferredMasking(0.5, 1), (dit.Internal(0.5), dit.SRA(1, 2))

def steps(K, scaled, masking=masking):
    dtype = jnp.float16 if scaled else jnp.float32
    graphdef, state, shardings = dit.init_state(cfg, tx, 0, mesh, False, jnp.float32, None)
    # placed as the step returns it: from one device, the second call would trace the step anew
    scale_state = dit.loss_scale_state(dtype)
    scale_shardings = jax.tree.map(lambda a: NamedSharding(mesh, P()), scale_state)
    state |= jax.device_put(scale_state, scale_shardings)
    shardings |= scale_shardings
    step = dit.jit_train_step(graphdef, dit.RectifiedFlow(), tx, 0.9, False, 0, mesh, shardings,
                              masking, terms, K)
    for _ in range(2):
        state, metrics = step(state, x, y)
    return jax.tree.map(np.asarray, (state, metrics)), step.lower(state, x, y).compile()

close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
for scaled in (False, True):
    (state, metrics), _ = steps(1, scaled)
    assert set(metrics["aux"]) == {{"internal", "sra"}} and metrics["count_by_t"].sum() == B
    assert ("loss_scale" in metrics) == scaled and not metrics.get("skipped", False)
    for K in (2, 4):
        (state_k, metrics_k), _ = steps(K, scaled)
        jax.tree.map(close, state_k, state)  # parameters, EMA, AdamW's moments, loss scale
        jax.tree.map(close, metrics_k, metrics)  # loss, loss_by_t, grad_norm, the terms
        np.testing.assert_array_equal(metrics_k["count_by_t"], metrics["count_by_t"])
# The micro-batches stay spread over the devices: the step gathers no sample (deferred masking's
# scatter of the kept patches gathers their indices, whatever K is).
assert "all-gather" not in steps(2, False, None)[1].as_text()
print("equal")
"""

@slow
def test_accumulated_micro_batches_update_as_the_whole_batch():
    """K micro-batches (K = 2, 4) give the whole batch's update: the same parameters, EMA and
    optimizer state after two steps, and the same logged losses, within float tolerance, with
    deferred masking, internal guidance's and SRA's terms, and float16's loss scaling, on two
    devices (on one, test_grad_accum_trains_and_resumes_as_the_whole_batch)."""
    out = subprocess.run([sys.executable, "-c", ACCUMULATION.format(here=HERE)],
                         env=process_env(2), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split() == ["equal"], out.stderr[-3000:]

@slow
def test_dispersive_loss_in_micro_batches_compares_each_ones_samples():
    """Dispersive loss, the one term over pairs of samples, is under accumulation the mean of each
    micro-batch's term (samples k, k + K, ...), not the batch's: from the tokens that the model
    gives the batch at t = 0 without noise, at a temperature where every pair counts."""
    model = lever_model(class_dropout_prob=0.0)

    class AtZero(dit.RectifiedFlow):  # x_t = x: the tokens are those of the batch itself
        def draw(self, key, x0):
            return jnp.zeros(x0.shape[0]), jnp.zeros_like(x0)

    x, y = jax.random.normal(jax.random.key(0), (8, 8, 8, 3)), jnp.arange(8) % 3
    tokens = jax.jit(lambda: model.forward(x, jnp.zeros(8), y, taps={2})[1]["block2"])()
    z = np.asarray(tokens, np.float64).reshape(8, -1)
    distances = ((z[:, None] - z[None]) ** 2).sum(-1) / z.shape[1]
    term = dit.Dispersive(block=2, weight=1.0, temperature=float(np.median(distances)))
    tx, _ = dit.make_optimizer(1e-3)
    mesh, state = dit.make_mesh(), dit.new_train_state(model, tx)
    shardings = dit.state_shardings(state, mesh, False)
    logged = {K: float(dit.jit_train_step(nnx.graphdef(model), AtZero(), tx, 0.9, False, 0, mesh,
                                          shardings, terms=(term,), grad_accum=K)(
        jax.tree.map(jnp.copy, state), x, y)[1]["aux"]["dispersive"]) for K in (1, 2)}
    of = lambda *parts: np.mean([float(term(seen_of({"block2": p}))) for p in parts])  # noqa: E731
    assert logged[1] == pytest.approx(of(tokens), rel=1e-4)
    assert logged[2] == pytest.approx(of(tokens[0::2], tokens[1::2]), rel=1e-4)
    for other in (of(tokens), of(tokens[:4], tokens[4:])):  # the batch's; other micro-batches'
        assert logged[2] != pytest.approx(other, rel=1e-2)

@slow
@pytest.mark.xdist_group("straight_run")
def test_grad_accum_trains_and_resumes_as_the_whole_batch(tmp_path, folder_data, straight_run):
    """--grad-accum is no setting of a run: 3 steps in 4 micro-batches on one device, resumed in 2
    a device over two devices, end at step 6 where the run of whole batches does, with its
    losses, within float tolerance."""
    run_dir = tmp_path / "run"
    run_dit(tmp_path, train_args(folder_data, run_dir, 3, [*VALIDATION, "--grad-accum", "4"]))
    out = run_dit(tmp_path, train_args(folder_data, run_dir, 6,
                                       [*VALIDATION, "--grad-accum", "2"]), devices=2)
    assert "resumed" in out.stdout and "2 devices" in out.stdout
    assert_states_close(state_at(run_dir, 6), state_at(straight_run, 6))
    losses = lambda run: [(r["step"], r["loss"]) for r in records(run)  # noqa: E731
                          if "loss" in r and r["step"] <= 6]
    np.testing.assert_allclose(losses(run_dir), losses(straight_run), rtol=1e-5)

def test_grad_accum_that_does_not_split_a_devices_share_ends_in_one_line(tmp_path, folder_data):
    with pytest.raises(dit.InputError, match=re.escape(
            "--grad-accum 3 does not split a device's 8 samples (--batch-size 8 over 1 devices) "
            "into equal micro-batches; use a divisor of 8")):
        dit.main(train_args(folder_data, tmp_path / "run", 1, ["--grad-accum", "3"]))

@slow
def test_a_step_that_does_not_fit_the_device_ends_in_one_line_with_what_fits(
        tmp_path, folder_data, monkeypatch):
    """Before the first step, XLA's count of the compiled step's memory against a device's (faked
    here: the CPU has no limit): over it, one line with its figures and what would fit, and the
    micro-batches it names then fit under the same limit."""
    limit = [1]
    monkeypatch.setattr(dit, "device_memory", lambda device: limit[0])
    monkeypatch.setitem(dit.DIT_SIZES, "XS", TINY_XS)
    # 64 samples of 16 tokens: activations outweigh the tiny model's parameters
    args = lambda k: train_args(folder_data, tmp_path / f"run{k}", 1, [  # noqa: E731
        "--batch-size", "64", "--grad-accum", str(k)])
    with pytest.raises(dit.InputError) as e:
        dit.main(args(1))
    line = str(e.value)
    figures = re.fullmatch(r"the training step needs ([\d.]+) MiB of a device's 0.00 MiB \(XLA's "
                           r"count: ([\d.]+) MiB of state and batch, [\d.]+ MiB of working memory "
                           r"at 64 samples a device at a time\); try --remat, a smaller "
                           r"--batch-size", line)
    assert figures, line  # no number of micro-batches fits in a byte
    need, fixed = (float(v) * 2**20 for v in figures.groups())
    limit[0] = int((need + fixed) / 2)  # room for half the working memory
    with pytest.raises(dit.InputError, match=r"; try --grad-accum (\d+) \(about [\d.]+ MiB\), "
                                             r"--remat, a smaller --batch-size$") as e:
        dit.main(args(1))
    k = int(re.search(r"--grad-accum (\d+)", str(e.value))[1])
    assert k in (2, 4, 8, 16, 32, 64)
    assert dit.main(args(k)).step == 1

def test_default_precision_per_device():
    """bf16 where the device computes it natively, fp16 on NVIDIA's Volta and Turing, fp32 on CPUs
    and older GPUs (XLA has no float16 products with float32 sums there)."""
    device = lambda platform, capability=None: types.SimpleNamespace(  # noqa: E731
        platform=platform, compute_capability=capability)
    assert dit.default_precision(device("cpu")) == "fp32"
    assert dit.default_precision(device("tpu")) == "bf16"
    for capability, name in [("9.0", "H100"), ("8.0", "A100"), ("8.9", "L4")]:
        assert dit.default_precision(device("gpu", capability)) == "bf16", name
    for capability, name in [("7.5", "T4"), ("7.0", "V100")]:
        assert dit.default_precision(device("gpu", capability)) == "fp16", name
    assert dit.default_precision(device("gpu", "6.0")) == "fp32"  # a P100

# split_cpu in a fresh process, on a machine of `cores` cores; prints the devices JAX then has.
SPLIT_CPU = """
import os, sys
sys.path.insert(0, {here!r})
import jax
import dit
os.sched_getaffinity = lambda pid: set(range({cores}))
{before}
dit.split_cpu({batch})
print(jax.device_count())
"""

@pytest.mark.parametrize("cores, batch, before, flags, devices", [
    (2, 16, "", "", 2),                      # the bench's DiT-S/2 batch: 8 samples a core
    (2, 12, "", "", 1),                      # 6 a core is too few
    (4, 24, "", "", 3),                      # 4 cores do not split 24 into shares of 8: 3 do
    (4, 32, "jax.devices()", "", 1),         # JAX has started: its one device stays
    (4, 32, "", "--xla_force_host_platform_device_count=3", 3),  # the user's count stays
])
@slow
def test_split_cpu_gives_each_core_a_device_and_a_share_of_the_batch(cores, batch, before, flags,
                                                                     devices):
    code = SPLIT_CPU.format(here=HERE, cores=cores, before=before, batch=batch)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == devices

# Sends the process a signal (in a multi-host run, process `process` alone) while the data loader
# prepares the second batch of the run: it arrives during the first step or the wait for the
# second, and before the second step's batch reaches the training loop.
SIGNAL_AT_SECOND_BATCH = """
import shlex
import signal
import jax
batch = dit.Loader.batch
def batch_and_signal(self, step):
    if step == self.start_step + 1 and jax.process_index() == {process}:
        os.kill(os.getpid(), signal.{signal})
    return batch(self, step)
dit.Loader.batch = batch_and_signal
"""

@slow
@pytest.mark.xdist_group("straight_run")
def test_ctrl_c_stops_with_a_checkpoint_and_resumes_exactly(tmp_path, folder_data, straight_run):
    """Ctrl-C (SIGINT) during a run's first steps ends it after a whole step, with a checkpoint of
    that step and one line that says so; the same command then ends as the uninterrupted run, bit
    for bit. (SIGTERM and --time-limit take the same way out of the loop: Stop.reason.)"""
    run_dir = tmp_path / "run"
    args = train_args(folder_data, run_dir, 9, VALIDATION)
    out = run_dit(tmp_path, args, patch=SIGNAL_AT_SECOND_BATCH.format(signal="SIGINT", process=0))
    last = out.stdout.splitlines()[-1]
    match = re.fullmatch("interrupted at step ([12]) of 9: saved (.+); the same command continues "
                         "from there", last)
    assert match, last  # the step under way when the signal came, or the one after
    step = int(match[1])
    assert match[2] == str(run_dir / "checkpoints" / f"step_{step:07d}.npz")
    assert int(dit.read_checkpoint(match[2])[1]["step"]) == step
    out = run_dit(tmp_path, args)
    assert f"resumed {match[2]}" in out.stdout
    a, b = state_at(straight_run, 9), final_state(run_dir)[1]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    resumed = records(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, 10))
    assert ([r for r in resumed if "val_loss" in r]
            == [r for r in records(straight_run) if "val_loss" in r])

# Holds its run directory: at its second batch it says so in a file, then waits to be killed.
WAIT_AT_SECOND_BATCH = """
import time
batch = dit.Loader.batch
def batch_and_wait(self, step):
    if step == 1:
        open({marker!r}, "w").close()
        time.sleep(300)
    return batch(self, step)
dit.Loader.batch = batch_and_wait
"""

@slow
def test_a_run_directory_holds_one_run_and_a_killed_holder_lets_go(tmp_path, folder_data):
    """A second run started in a run directory in use ends in one line naming the holder's host
    and process id, before its work; once the holder is killed (-9), a run starts there and logs
    each step once."""
    run_dir, marker = tmp_path / "run", tmp_path / "holding"
    args = train_args(folder_data, run_dir, 3)
    script = tmp_path / "holder.py"
    script.write_text(driver_text(WAIT_AT_SECOND_BATCH.format(marker=str(marker))))
    holder = subprocess.Popen([sys.executable, str(script), *args], env=process_env(1),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the first run ended"
            time.sleep(0.5)
        second = run_dit(tmp_path, args, check=False)
        assert second.returncode == 1 and "DiT-XS/2" not in second.stdout
        assert second.stderr.splitlines() == [
            f"error: {run_dir} is in use by the run of process {holder.pid} on "
            f"{socket.gethostname()} (it holds {run_dir / 'lock'}): wait for it to end, or train "
            f"in another --run-dir"]
    finally:
        holder.kill()
        holder.wait()
    run_dit(tmp_path, args)
    assert [r["step"] for r in records(run_dir) if "loss" in r] == [1, 2, 3]

def test_a_process_holds_a_run_directory_once_and_lets_go_at_the_end(tmp_path, monkeypatch,
                                                                    capsys):
    """A second hold by the same process (a notebook's train() while another runs in a thread) is
    refused too, naming this process; a hold ends with its block, an error's too. A file system
    without locks, or Windows (no fcntl), lets the run go on with a note."""
    refused = (f"{tmp_path} is in use by the run of process {os.getpid()} on "
               f"{socket.gethostname()}")
    with dit.holding(str(tmp_path), local_disks=False):
        with pytest.raises(dit.InputError, match=re.escape(refused)):
            with dit.holding(str(tmp_path), local_disks=False):
                pass
    with pytest.raises(KeyboardInterrupt):
        with dit.holding(str(tmp_path), local_disks=False):
            raise KeyboardInterrupt
    with dit.holding(str(tmp_path), local_disks=False):
        assert str(tmp_path) in dit.HELD_RUN_DIRS
    assert not dit.HELD_RUN_DIRS
    # a file system without locks: the run goes on, with a note
    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    import fcntl
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with dit.holding(str(tmp_path), local_disks=False):
        assert capsys.readouterr().out.startswith(f"note: {tmp_path / 'lock'} cannot be locked "
                                                  f"({os.strerror(errno.ENOLCK)})")
    monkeypatch.setitem(sys.modules, "fcntl", None)  # as on Windows: the import fails
    with dit.holding(str(tmp_path), local_disks=False):
        assert capsys.readouterr().out.startswith(f"note: {tmp_path / 'lock'} cannot be locked "
                                                  f"(import of fcntl halted")

def test_stop_handles_signals_only_inside_and_only_in_the_main_thread():
    """Inside `with Stop`, SIGTERM and a first SIGINT ask for a stop, a second SIGINT raises
    KeyboardInterrupt at once; outside, the handlers from before are back (a notebook calls main()
    many times). From another thread, where Python installs no handler, only the time limit
    stops."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with dit.Stop(None) as stop:
        assert stop.reason(1) is None
        signal.raise_signal(signal.SIGTERM)
        assert stop.reason(1) == "interrupted"
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with pytest.raises(KeyboardInterrupt), dit.Stop(None) as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.reason(1) == "interrupted"
        signal.raise_signal(signal.SIGINT)
    assert {sig: signal.getsignal(sig) for sig in before} == before
    reasons = []

    def in_a_thread():
        with dit.Stop(0.01) as stop:
            time.sleep(0.02)
            reasons.append(stop.reason(1))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert reasons == ["reached --time-limit"]

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2])
def test_each_scheduler_signal_stops_after_the_step(sig):
    """SIGTERM (a job's end, scancel) and SLURM's `--signal` warnings, SIGUSR1 or SIGUSR2, each
    ask for a stop, which only the next check reports; none ends the process."""
    with dit.Stop(None) as stop:
        assert stop.reason(1) is None
        signal.raise_signal(sig)
        assert stop.reason(2) == "interrupted"
    assert signal.getsignal(sig) is signal.SIG_DFL

@pytest.mark.parametrize("text, seconds", [("59:30", 3570), ("1:00:00", 3600), ("0:05", 5),
                                           ("2-03:04:05", ((2 * 24 + 3) * 60 + 4) * 60 + 5),
                                           ("UNLIMITED", None), ("NOT_SET", None), ("", None)])
def test_slurm_time_left_is_read_as_squeue_prints_it(text, seconds):
    assert dit.slurm_time_left(text + "\n") == seconds

def test_a_slurm_job_stops_the_run_before_its_end_with_time_for_the_checkpoint(monkeypatch):
    """A job's end less the margin stops the run, and names the job's end; the margin grows to
    twice the longest pause between steps (plus the slack); --time-limit stops first where it is
    earlier, and names itself."""
    clock = [1000.0]
    monkeypatch.setattr(dit.time, "monotonic", lambda: clock[0])
    stop = dit.Stop(None, job_end=1000.0 + 600)
    assert stop.deadline == 1600 - dit.JOB_END_SLACK
    stop.paused(100.0)
    stop.paused(10.0)  # a shorter pause does not narrow it
    assert stop.deadline == 1600 - dit.JOB_END_SLACK - 200
    clock[0] = 1600 - dit.JOB_END_SLACK - 201
    assert stop.reason(1) is None
    clock[0] += 2
    assert stop.reason(2) == "reached the SLURM job's end"
    clock[0] = 1000.0
    early = dit.Stop(60, job_end=1000.0 + 600)
    clock[0] = 1061.0
    assert early.reason(1) == "reached --time-limit"
    # squeue's answer for the job named in the environment; none outside a job
    assert dit.slurm_job_end({}) is None

@pytest.mark.parametrize("text, seconds", [("8h30m", 8 * 3600 + 30 * 60), ("90m", 5400),
                                           ("45s", 45), ("1h", 3600), ("2m30s", 150)])
def test_time_limit_is_read_as_hours_minutes_seconds(text, seconds):
    assert dit.build_parser().parse_args(["train", "--time-limit", text]).time_limit == seconds

@pytest.mark.parametrize("text", ["8", "8x", "30m8h", "0s", "", "1.5h"])
def test_time_limit_that_is_no_duration_is_refused_by_the_parser(text):
    with pytest.raises(dit.InputError, match=re.escape(
            f"argument --time-limit: expected a duration such as 8h30m, 90m or 45s, got {text!r}")):
        dit.main(["--time-limit", text])

def test_progress_is_shown_against_the_bound_that_comes_first(monkeypatch):
    """A run bounded by --time-limit ends where the limit stops it, at the speed so far, and the
    progress bar's total says so (with --steps 100000000, the bar's ETA would otherwise be
    years); the step count where it comes first, and without a limit."""
    clock = [1000.0]
    monkeypatch.setattr(dit.time, "monotonic", lambda: clock[0])
    stop = dit.Stop(3600)
    clock[0] += 60  # a minute after the start, a run resumed at step 500 has done 100 steps:
    assert stop.last_step(500, 600, 100_000_000) == 600 + 59 * 100  # 59 more minutes of them
    assert stop.last_step(500, 600, 2_000) == 2_000
    assert dit.Stop(None).last_step(500, 600, 100_000_000) == 100_000_000
    clock[0] += 3600  # past the limit: the step under way is the last
    assert stop.last_step(500, 600, 100_000_000) == 600

def test_a_share_of_the_time_passes_against_the_deadline(monkeypatch):
    """Stop.past: whether a share of the time from the start to the deadline has passed (--unmask-at
    90%); never without a deadline."""
    clock = [1000.0]
    monkeypatch.setattr(dit.time, "monotonic", lambda: clock[0])
    stop, unbounded = dit.Stop(3600), dit.Stop(None)
    clock[0] += 0.9 * 3600 - 1
    assert not stop.past(0.9, 5) and stop.past(0.5, 5)
    clock[0] += 2
    assert stop.past(0.9, 5) and not unbounded.past(0.01, 5)

@slow
@pytest.mark.xdist_group("straight_run")
def test_time_limited_run_shows_its_progress_against_the_limit(tmp_path, folder_data,
                                                               straight_run):
    """The README's command for runs bounded by time (`--steps 100000000 --time-limit 20m`) at a
    tiny size: from the first step on, the bar counts towards the step where the limit will stop
    the run, and last shows the step where it did. (straight_run has compiled the same step into
    the session's compilation cache: the limit goes to steps, not to compiling; 15 s, as loading
    the step took more than 5 s with the suite's other processes on both cores.)"""
    out = run_dit(tmp_path, train_args(folder_data, tmp_path / "run", 100_000_000,
                                       ["--time-limit", "15s", "--log-every", "50",
                                        "--ckpt-every", "1000"]))
    last = int(re.search(r"reached --time-limit at step (\d+) of 100000000", out.stdout)[1])
    bars = [(int(n), int(total)) for n, total in re.findall(r"(\d+)/(\d+) \[", out.stderr)]
    bars = bars[bars.index((0, 100_000_000)):]  # before the first step, all that it knows
    assert any(n > 0 for n, _ in bars) and all(total < 100_000_000 for n, total in bars if n > 0)
    # the deadline may pass between the bar's update and the check that stops the run
    assert last <= bars[-1][1] <= last + 1, bars[-3:]

# Records, in a training run, each compilation (jax.monitoring's backend compile event, which a
# program loaded from the compilation cache also sends) and each read of a device array by the host,
# with the step under way: StepTrace is called before each step, and once after the last. The steps
# after the first run under jax.transfer_guard("disallow"), where an implicit transfer, such as a
# numpy array or a Python number passed to a jitted function, fails. A CPU's device arrays are host
# memory and its guard lets their reads pass, hence the record of reads: every read of an array
# (np.asarray, float, .item(), jax.device_get) goes through ArrayImpl._value.
RECORD_COMPILES_AND_READS = """
import atexit, contextlib, json
import jax
from jax._src import array
events, now, guard = [], [None], contextlib.ExitStack()
def compiled(event, seconds, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        events.append(["compile", now[0], kwargs["fun_name"]])
jax.monitoring.register_event_duration_secs_listener(compiled)
value = array.ArrayImpl._value
def read(self):
    events.append(["read", now[0], None])
    return value.fget(self)
array.ArrayImpl._value = property(read)
trace, begun = dit.StepTrace.__call__, []
def step_begins(self, step, state):
    begun.append(step)
    if len(begun) == 2:  # the second step, and all after it
        guard.enter_context(jax.transfer_guard("disallow"))
    now[0] = step
    trace(self, step, state)
dit.StepTrace.__call__ = step_begins
atexit.register(lambda: print("EVENTS", json.dumps(events)))
"""

def compiles_and_reads(stdout, steps):
    """(the compilations during the loop as (step under way, program), the steps after which
    the host read a device array), from RECORD_COMPILES_AND_READS's record of a run of `steps`
    steps. A read while step s (from 0) is under way comes after step s + 1; the trace's call
    after the loop, with s = steps, begins the run's end, which comes after step `steps`."""
    events = json.loads(re.search("^EVENTS (.*)$", stdout, re.M)[1])
    compiles = sorted((step, name) for kind, step, name in events
                      if kind == "compile" and step is not None)
    return compiles, {min(step + 1, steps) for kind, step, _ in events
                      if kind == "read" and step is not None}

@slow
def test_each_program_compiles_once_and_the_loop_waits_for_the_host_only_where_planned(
        tmp_path, folder_data):
    """A run's training step compiles once, at its first step, and the grid's sampler, its
    conversion to images and the validation loss once, at the first evaluation, in a new run and in
    one resumed in a new process, with FSDP's shardings over 2 devices. The host reads from the
    devices only after the steps that log (every 4), evaluate and checkpoint (every 3) and at the
    end, and no step transfers anything implicitly (jax.transfer_guard)."""
    def run(steps):
        out = run_dit(tmp_path, train_args(folder_data, tmp_path / "run", steps,
                                           ["--log-every", "4", "--sample-every", "3", "--fsdp",
                                            *VALIDATION]),
                      devices=2, patch=RECORD_COMPILES_AND_READS)
        return compiles_and_reads(out.stdout, steps)

    def programs(first_step, first_evaluation):  # steps from 0; "<lambda>": the validation loss
        return sorted([(first_step, "jit(train_step)"), (first_evaluation, "jit(run)"),
                       (first_evaluation, "jit(finish)"), (first_evaluation, "jit(<lambda>)")])

    compiles, reads = run(9)
    assert compiles == programs(0, 2)
    assert reads == {3, 4, 6, 8, 9}
    compiles, reads = run(15)  # resumed at step 9
    assert compiles == programs(9, 11)
    assert reads == {12, 15}

# Counts what JAX's persistent compilation cache did: programs looked up, found, and written.
COUNT_CACHE = """
import atexit, collections, json
import jax
counts = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **kwargs: counts.update([event]))
atexit.register(lambda: print("CACHE", json.dumps(counts)))
"""

@slow
def test_a_second_run_loads_every_program_from_the_compilation_cache(tmp_path, folder_data):
    """The compilation cache is on by default, in compile_cache beside the run directory: a second
    process with the same settings loads every program that the first compiled and compiles none.
    --no-compile-cache leaves it alone."""
    cache = tmp_path / "runs" / "compile_cache"

    def run(name, *extra):
        # JAX_COMPILATION_CACHE_DIR empty: the test session's shared cache would take precedence
        out = run_dit(tmp_path, train_args(folder_data, tmp_path / "runs" / name, 3,
                                           [*VALIDATION, *extra]),
                      patch=COUNT_CACHE, env={"JAX_COMPILATION_CACHE_DIR": ""})
        counts = json.loads(re.search("^CACHE (.*)$", out.stdout, re.M)[1])
        return [counts.get(f"/jax/compilation_cache/{event}", 0)
                for event in ("compile_requests_use_cache", "cache_hits", "cache_misses")]

    requests, hits, writes = run("first")
    assert requests > 0 and hits == 0 and writes == requests
    entries = sorted(cache.glob("*-cache"))  # one file a program
    assert len(entries) == requests
    assert run("second") == [requests, requests, 0]
    assert run("third", "--no-compile-cache") == [0, 0, 0]
    assert sorted(cache.glob("*-cache")) == entries

# DiT+ (RoPE on the kept tokens) with deferred masking, every patch after step 3, checkpoints every
# 2 steps.
MASKING = ["--arch", "dit+", "--mask-ratio", "0.5", "--mixer-depth", "1", "--ckpt-every", "2",
           "--unmask-at", "3"]

@pytest.fixture(scope="module")
def masked_run(tmp_path_factory, folder_data):
    """Six uninterrupted steps with MASKING on one device: checkpoints at steps 2, 4 and 6,
    validation losses at 3 and 6."""
    run_dir = tmp_path_factory.mktemp("masked") / "run"
    run_dit(run_dir.parent, train_args(folder_data, run_dir, 6, [*VALIDATION, *MASKING]))
    return run_dir

@slow
@pytest.mark.xdist_group("masked_run")
def test_masked_training_resumes_exactly(tmp_path, folder_data, masked_run):
    """With deferred masking, a run resumed at step 2 (a masked step, then the final phase on every
    patch) ends bit for bit as the uninterrupted one. The masking is recorded and defines the run;
    --unmask-at may move when a run resumes, and moving it changes what is trained."""
    step2 = str(masked_run / "checkpoints" / "step_0000002.npz")
    run_dit(tmp_path, train_args(folder_data, tmp_path / "resumed", 6,
                                 [*VALIDATION, *MASKING, "--resume", step2]))
    a, b = state_at(masked_run, 6), final_state(tmp_path / "resumed")[1]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert ([r for r in records(tmp_path / "resumed") if "val_loss" in r]
            == [r for r in records(masked_run) if "val_loss" in r])
    meta = final_state(masked_run)[0]
    assert meta["settings"]["masking"] == {"mask_ratio": 0.5, "mixer_depth": 1}
    assert meta["unmask_at"] == 3
    with pytest.raises(dit.InputError, match=re.escape(
            "holds another run (masking: {'mask_ratio': 0.5, 'mixer_depth': 1} -> None)")):
        dit.main(train_args(folder_data, masked_run, 9, [*VALIDATION, "--arch", "dit+"]))
    run_dit(tmp_path, train_args(folder_data, tmp_path / "later", 6,
                                 [*VALIDATION, *MASKING[:-1], "6", "--resume", step2]))
    c = final_state(tmp_path / "later")[1]
    assert not all(np.array_equal(a[k], c[k]) for k in a)

# dit.py's clock (Stop's) moves on one second with each training step, from 0 at the start.
STEP_CLOCK = """
import time, types
clock = [0.0]
dit.time = types.SimpleNamespace(**{**vars(time), "monotonic": lambda: clock[0]})
jit_train_step = dit.jit_train_step
def ticking(*args, **kwargs):
    step = jit_train_step(*args, **kwargs)
    def tick(*batch):
        clock[0] += 1
        return step(*batch)
    return tick
dit.jit_train_step = ticking
"""

@slow
@pytest.mark.xdist_group("masked_run")
def test_a_share_of_a_time_limited_run_ends_masking_and_resumes_exactly(tmp_path, folder_data,
                                                                       masked_run):
    """`--unmask-at 60%` under `--time-limit 4s`, a step a second: 60% of the time (2.4 s) comes
    before 60% of the 6 steps, so steps 3 on see every patch, as in masked_run (--unmask-at 3).
    Stopped at 5 and resumed with 99% (alone, step 5 would be masked), it stays unmasked and ends
    as masked_run; resumed from step 2 at 50%, 50% of the steps (3) come first."""
    def run(run_dir, share, *extra):
        return run_dit(tmp_path, train_args(folder_data, run_dir, 6, [
            *VALIDATION, *MASKING[:-1], share, "--time-limit", "4s", *extra]), patch=STEP_CLOCK)

    out = run(tmp_path / "a", "60%")
    assert "step 3: every patch from here on (--unmask-at 60% of the time)" in out.stdout
    assert "reached --time-limit at step 5 of 6" in out.stdout
    assert {"step": 3, "unmasked": True} in records(tmp_path / "a")
    a, b = state_at(tmp_path / "a", 4), state_at(masked_run, 4)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert dit.read_checkpoint(str(tmp_path / "a" / "checkpoints" / "step_0000005.npz"),
                               names=[])[0]["unmask_at"] == 3
    out = run(tmp_path / "a", "99%")
    assert "every patch from here on" not in out.stdout
    step2 = str(masked_run / "checkpoints" / "step_0000002.npz")
    out = run(tmp_path / "b", "50%", "--resume", step2)
    assert "step 3: every patch from here on (--unmask-at 50% of the steps)" in out.stdout
    b = state_at(masked_run, 6)
    for run_dir in ("a", "b"):
        a = final_state(tmp_path / run_dir)[1]
        assert int(a["step"]) == 6
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{run_dir}: {k}")

@slow
@pytest.mark.xdist_group("masked_run")
def test_eight_devices_with_fsdp_equal_one(tmp_path, folder_data, masked_run):
    """The 8 devices of a TPU v3-8 sharing the batch (one sample each) and, with --fsdp, the
    parameters and optimizer state == 1 device, over three steps with deferred masking (each image
    keeps the same patches wherever it is) and one on every patch (sharing the batch alone is what
    test_two_hosts_equal_one runs, on 2 x 2 devices)."""
    run_dit(tmp_path, train_args(folder_data, tmp_path / "run", 4,
                                 [*VALIDATION, *MASKING, "--fsdp"]), devices=8)
    one = state_at(masked_run, 4)
    assert int(one["step"]) == 4
    # the parameters moved: the comparison is not between two untouched initialisations
    meta, _ = final_state(masked_run)
    start = nnx.to_pure_dict(nnx.state(dit.DiT(dit.DiTConfig(**meta["model"]), rngs=nnx.Rngs(0)),
                                       nnx.Param))
    assert not np.allclose(one["params.blocks.0.attn.qkv.kernel"],
                           np.asarray(start["blocks"][0]["attn"]["qkv"]["kernel"]))
    assert_states_close(one, final_state(tmp_path / "run")[1])

@slow
def test_validation_images_of_any_count_on_any_devices(tmp_path, folder_data):
    """--val-images 10 on 8 devices, which 10 does not split over: padded to 16 and the padding
    left out, the same held-out images give the same validation figures as on 1 device."""
    figures = []
    for devices in (1, 8):
        run_dir = tmp_path / f"devices{devices}"
        run_dit(tmp_path, train_args(folder_data, run_dir, 2, ["--val-images", "10",
                                                               "--val-every", "1"]),
                devices=devices)
        figures.append([r for r in records(run_dir) if "val_loss" in r])
    one, eight = figures
    assert [r["step"] for r in one] == [r["step"] for r in eight] == [1, 2]
    for a, b in zip(one, eight):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
        assert b["val_loss_t"] == pytest.approx(a["val_loss_t"], rel=1e-5)
    assert one[0]["val_loss"] != one[1]["val_loss"]  # the figures follow the weights

def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]

# A pair of processes joined by jax.distributed on the CPU would each compile every program: JAX
# writes the cache from process 0 alone, and files a program under a key that hashes the CPU's
# topology as each process sees it, so that process 1 finds none of process 0's programs. Keyed by
# the devices' kind, as JAX keys a backend that has no topology to hash, process 1 loads what
# process 0 compiled, from the cache or, as process 0 compiles it, from process 0 itself
# (jax_share_binary_between_hosts): the nine tests of such pairs, run alone, take 243 s of CPU
# rather than 287 s; process 1 waits for a program 2 minutes at most (JAX's default: 20). Where JAX
# names these otherwise, both processes compile.
SHARED_PROGRAMS = """
import jax
from jax._src import cache_key
if hasattr(cache_key, "_hash_accelerator_config") and hasattr(cache_key, "_hash_devices"):
    cache_key._hash_accelerator_config = cache_key._hash_devices
    jax.config.update("jax_share_binary_between_hosts", True)
    jax.config.update("jax_share_binary_between_hosts_timeout_ms", 120_000)
"""

def two_processes(tmp_path, argvs, devices=2, patch="", cwds=(None, None)):
    """Run dit.py with argvs[k] as process k of 2 joined by jax.distributed on localhost, each
    with `devices` CPU devices, in cwds[k]: (exit statuses, outputs). Process 0 joins by the
    command-line flags, process 1 as the second task of a SLURM job would, from the environment
    (JAX reads the task count and index from SLURM's variables)."""
    port = free_port()
    script = tmp_path / "driver.py"
    script.write_text(driver_text(SHARED_PROGRAMS + patch))
    env = process_env(devices)
    slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
             "JAX_COORDINATOR_ADDRESS": f"localhost:{port}"}
    joins = [(["--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", "0"],
              {}), ([], slurm)]
    # Outputs go to files, not pipes: a process blocked on a full pipe that is not being read would
    # hold the other in a collective.
    logs = [tempfile.TemporaryFile("w+", errors="replace") for _ in argvs]
    procs = [subprocess.Popen([sys.executable, str(script), *argv, *flags], env={**env, **more},
                              cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True)
             for argv, (flags, more), cwd, log in zip(argvs, joins, cwds, logs)]
    for p in procs:
        p.wait(timeout=300)
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    return [p.returncode for p in procs], outs

def run_two_hosts(tmp_path, data_dir, run_dirs, steps, patch=""):
    """Train on 2 processes x 2 devices, process k in run_dirs[k]: the outputs of both."""
    codes, outs = two_processes(tmp_path, [train_args(data_dir, run_dir, steps, VALIDATION)
                                           for run_dir in run_dirs], patch=patch)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    return outs

@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory, folder_data):
    """Three steps on 2 processes x 2 devices sharing one run directory: (run directory, output of
    process 0)."""
    tmp_path = tmp_path_factory.mktemp("two_hosts")
    run_dir = tmp_path / "multi"
    return run_dir, run_two_hosts(tmp_path, folder_data, [run_dir, run_dir], 3)[0]

@slow
@pytest.mark.xdist_group("straight_run")
def test_two_hosts_equal_one(two_hosts, straight_run):
    """2 processes x 2 devices == 1 process x 1 device."""
    run_dir, out = two_hosts
    assert "4 devices, 2 processes" in out
    assert_states_close(state_at(straight_run, 3), final_state(run_dir)[1])

@slow
@pytest.mark.xdist_group("straight_run")
def test_hosts_with_their_own_disks_stop_together_and_resume_exactly(tmp_path, folder_data,
                                                                     two_hosts):
    """Each process's run directory is a folder of its own, as on the local disks of a TPU pod
    slice's hosts. SIGTERM reaches process 1 alone during step 1; the processes agree on stopping
    every STOP_CHECK_EVERY steps (2 here), so both stop after step 2, each with its own whole copy
    of the checkpoint, and resume from their own disks to end as the run that shares one
    directory and was never stopped, bit for bit."""
    run_dirs = [tmp_path / "host0" / "run", tmp_path / "host1" / "run"]
    patch = "dit.STOP_CHECK_EVERY = 2\n" + SIGNAL_AT_SECOND_BATCH.format(signal="SIGTERM",
                                                                         process=1)
    outs = run_two_hosts(tmp_path, folder_data, run_dirs, 3, patch)
    ckpt = run_dirs[0] / "checkpoints" / "step_0000002.npz"
    assert outs[0].splitlines()[-1] == (f"interrupted at step 2 of 3: saved {ckpt} (on every "
                                        f"host); the same command continues from there")
    copies = [state_at(run_dir, 2) for run_dir in run_dirs]
    for k in copies[0]:
        np.testing.assert_array_equal(copies[0][k], copies[1][k], err_msg=k)
    assert all(os.path.exists(run_dir / "run.json") for run_dir in run_dirs)
    outs = run_two_hosts(tmp_path, folder_data, run_dirs, 3)
    assert all("resumed" in out for out in outs)
    straight = final_state(two_hosts[0])[1]
    for run_dir in run_dirs:
        resumed = final_state(run_dir)[1]
        assert int(resumed["step"]) == 3
        for k in straight:
            np.testing.assert_array_equal(straight[k], resumed[k], err_msg=k)
    assert [r["step"] for r in records(run_dirs[0]) if "loss" in r] == [1, 2, 3]
    # Each host goes on from its own checkpoint of step 2 in a new folder of its own, which begins
    # with the history on its disk (process 0 keeps the metrics, and tells).
    branches = [run_dir.parent / "branch" for run_dir in run_dirs]
    codes, outs = two_processes(tmp_path, [train_args(folder_data, branch, 3, [
        *VALIDATION, "--resume", str(run_dir / "checkpoints" / "step_0000002.npz")])
        for run_dir, branch in zip(run_dirs, branches)])
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert outs[0].count(f"continues {run_dirs[0]} at step 2: ") == 1
    assert [r["step"] for r in records(branches[0]) if "loss" in r] == [1, 2, 3]
    assert records(branches[1]) == [{"step": 2, "continues": str(run_dirs[1])}]
    for branch in branches:
        for k in straight:
            np.testing.assert_array_equal(straight[k], final_state(branch)[1][k], err_msg=k)

@slow
def test_hosts_that_found_different_data_or_checkpoints_end_in_one_line(tmp_path, folder_data):
    """Each host reads its own disk; where they found different data, or one lacks the checkpoint
    to resume from, every host ends before the first step in the same line, naming the process."""
    copy = tmp_path / "host1" / "data"
    shutil.copytree(folder_data, copy)
    os.remove(copy / "squares" / "0.png")
    run_dirs = [tmp_path / "host0" / "run", tmp_path / "host1" / "run"]
    codes, outs = two_processes(tmp_path, [train_args(folder_data, run_dirs[0], 2),
                                           train_args(copy, run_dirs[1], 2)])
    line = ("error: the hosts found different data (96 samples of 8x8x3 in 2 classes on process 0, "
            "95 samples of 8x8x3 in 2 classes on process 1): copy the same data to every host "
            "(--data-dir)")
    assert codes[0] != 0 and codes[1] != 0, outs
    assert [out.splitlines()[-1] for out in outs] == [line, line], outs
    # --resume names a file on host 0's disk only (its contents are never read: process 1 has
    # none, which ends both first)
    (tmp_path / "host0").mkdir(exist_ok=True)  # made by the first runs: their --run-dir's parent
    (tmp_path / "host0" / "step_0000002.npz").touch()
    argv = train_args(folder_data, "run", 2, ["--resume", "step_0000002.npz"])
    codes, outs = two_processes(tmp_path, [argv, argv], cwds=[tmp_path / "host0",
                                                              tmp_path / "host1"])
    line = "error: process 1: --resume: no checkpoint step_0000002.npz"
    assert codes[0] != 0 and codes[1] != 0, outs
    assert [out.splitlines()[-1] for out in outs] == [line, line], outs
    assert not any(os.path.exists(run_dir / "checkpoints") for run_dir in run_dirs)

# The README's course section on a pod slice of 2 hosts x 8 devices, each host with a local disk:
# a folder per process, its working directory, where it runs the README's commands as they are
# written, with toy sizes added. What differs: a DiT-S here is 32 wide and 2 deep; the processes
# join by --coordinator (process 1 from SLURM's variables) as a pod slice's would by themselves;
# the Inception has random weights (--inception), and its network gives its three outputs from each
# image's mean pixel (its 299x299 inputs took two fifths of the first test's CPU; the parity tests
# check the network, test_fid_features_sharded_over_two_devices its batches over devices); and the
# Frechet distance's square root of two 2048-d covariances of 16 images, which takes minutes on a
# 2-core CPU, is replaced by the distance of the means (test_fid_frechet_distance_* test the real
# one): these tests are of the hosts' paths through the collectives. Each host places the weights
# that every device reads (the Inception's, the model's) on its own devices: an array that JAX
# compares across the hosts, as device_put does with a host's array, is at most a few numbers (keys,
# sizes).
COURSE = """
import fid
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
dit.DIT_SIZES["S"] = dict(hidden_size=32, depth=2, num_heads=2)
def mean_pixel(inception, images, protocol):
    pool = jnp.tile(images.mean(axis=(1, 2, 3))[:, None] / 255, (1, 2048))  # (B, 2048)
    return pool, inception.fc(pool), pool[:, :fid.SPATIAL_DIM]
fid.InceptionV3.__call__ = mean_pixel
fid.frechet_distance = lambda mu1, sigma1, mu2, sigma2: float(((mu1 - mu2) ** 2).sum())
compare = multihost_utils.assert_equal
def compare_few(x, fail_message=""):
    assert np.size(x) <= 64, f"{np.shape(x)} compared across the hosts"
    compare(x, fail_message)
multihost_utils.assert_equal = compare_few
"""
COURSE_RUN = os.path.join("runs", "imagenet100-DiT-S-2")

def course_tree(root):
    """A Kaggle-layout ImageNet-100 download (train.X1, train.X2, Labels.json) of 4 classes x 260
    generated 10x8 JPEGs: more than the course's 1,000 held-out images."""
    wnids = [f"n0000000{c}" for c in range(4)]
    rng = np.random.default_rng(0)
    for c, wnid in enumerate(wnids):
        folder = root / f"train.X{1 + c // 2}" / wnid
        folder.mkdir(parents=True)
        for i in range(260):
            pixels = rng.integers(0, 64, (8, 10, 3), dtype=np.uint8) + 64 * c
            Image.fromarray(pixels).save(folder / f"{i}.JPEG")
    (root / "Labels.json").write_text(json.dumps({w: f"class {c}" for c, w in enumerate(wnids)}))

@pytest.fixture(scope="module")
def course_data(tmp_path_factory, inception_weights):
    """Steps 1 and 2 of the course: the download, its training split (not the optional validation
    split) prepared into in100-256/ with its FID reference. At toy scale: --pixels 8 rather than
    latents, and the reference is `fid.py ref` of 16 of the images rather than prepare's of all
    1,040 (--no-fid), which would take minutes here."""
    root = tmp_path_factory.mktemp("course")
    course_tree(root / "imagenet100")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        prepare_imagenet100.main(["imagenet100/", "in100-256/", "--pixels", "8", "--no-fid"])
        with pytest.warns(UserWarning):  # random Inception weights; 16 images' singular covariance
            fid.main(["ref", "imagenet100/train.X1", "in100-256/fid_ref.npz", "--images", "16",
                      "--batch-size", "16", "--weights", inception_weights])
    finally:
        os.chdir(cwd)
    return root / "in100-256"

def course_hosts(tmp_path, data, fid_ref_on=(0, 1)):
    """Each host's disk (a folder) with its copy of the prepared data, the FID reference on the
    hosts fid_ref_on only."""
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for k, host in enumerate(hosts):
        shutil.copytree(data, host / "in100-256",
                        ignore=None if k in fid_ref_on else shutil.ignore_patterns("fid_ref.npz"))
    return hosts

def course_train(inception_weights):
    """Step 3's command, with toy sizes added: batches of 16, 4 steps, FID-16 of 2-step samples."""
    return ["--size", "S", "--dataset", "imagenet100", "--data-dir", "in100-256/",
            "--val-images", "1000", "--batch-size", "16", "--steps", "4", "--final-fid", "16",
            "--sample-steps", "2", "--inception", inception_weights]

@slow
@pytest.mark.xdist_group("course_data")
def test_course_on_a_pod_slice_with_local_disks(tmp_path, course_data, inception_weights):
    """The course on 2 hosts x 8 devices, each host with its own copy of the prepared data: step
    3's training with 1,000 held-out images (which 16 devices do not split), stopped by a SIGTERM
    on host 1 and continued by the same command from each host's own checkpoint, ending with FID;
    then step 4's grid and FID with a guidance sweep, on both hosts."""
    hosts = course_hosts(tmp_path, course_data)
    train = course_train(inception_weights)
    stop = "dit.STOP_CHECK_EVERY = 2\n" + SIGNAL_AT_SECOND_BATCH.format(signal="SIGTERM",
                                                                         process=1)
    codes, outs = two_processes(tmp_path, [train, train], 8, COURSE + stop, hosts)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    ckpt = os.path.join(COURSE_RUN, "checkpoints", "step_0000002.npz")
    assert outs[0].splitlines()[-1] == (f"interrupted at step 2 of 4: saved {ckpt} (on every "
                                        f"host); the same command continues from there")
    assert "(1040 samples, input 8x8x3, 4 classes)" in outs[0]
    assert "16 devices, 2 processes" in outs[0]

    codes, outs = two_processes(tmp_path, [train, train], 8, COURSE, hosts)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert all(f"resumed {ckpt}" in out for out in outs)
    assert all(re.search(r"^step 4: FID-16 \(adm\) [\d.]+, sFID-16", out, re.M) for out in outs)
    run = records(hosts[0] / COURSE_RUN)
    assert [r["step"] for r in run if "loss" in r] == [2, 4]  # each step's record once
    [val] = [r for r in run if "val_loss" in r]
    assert val["step"] == 4 and np.isfinite(val["val_loss"])
    assert np.mean(list(val["val_loss_t"].values())) == pytest.approx(val["val_loss"])
    [scores] = [r for r in run if "fid" in r and "cfg_scale" not in r]
    assert scores["fid_samples"] == 16 and scores["fid_protocol"] == "adm"
    # at the guidance that its sweep chose: CFG's 7 settings (no EMA kept in 4 steps), 2 samples
    # each
    sweep = [r for r in run if "cfg_scale" in r]
    assert len(sweep) == 7 and {r["fid_samples"] for r in sweep} == {2}
    assert scores["guidance"].endswith("the best of 7 settings at 2 samples each")
    for host in hosts:  # each host resumed from its own copy and has the EMA weights to sample
        assert (host / COURSE_RUN / "ema.safetensors").exists()

    grid = ["sample", "--ckpt", f"{COURSE_RUN}/ema.safetensors", "--cfg-scale", "4", "--n", "64",
            "--out", "grid.png", "--steps", "2"]
    codes, outs = two_processes(tmp_path, [grid, grid], 8, COURSE, hosts)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert Image.open(hosts[0] / "grid.png").size == (8 * 10 + 2, 8 * 10 + 2)
    sweep = ["sample", "--ckpt", f"{COURSE_RUN}/ema.safetensors", "--fid", "16", "--ref",
             "in100-256/fid_ref.npz", "--cfg-scale", "1,3", "--steps", "2", "--inception",
             inception_weights]
    codes, outs = two_processes(tmp_path, [sweep, sweep], 8, COURSE, hosts)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for scale in ("1", "3"):
        assert re.search(rf"^guidance {scale}: FID-16 \(adm\) [\d.]+", outs[0], re.M), outs[0]
        with np.load(hosts[0] / f"samples_cfg{scale}.npz") as f:
            assert f["arr_0"].shape == (16, 8, 8, 3)

@slow
@pytest.mark.xdist_group("course_data")
def test_course_host_without_the_fid_reference_ends_every_host(tmp_path, course_data,
                                                               inception_weights):
    """Host 1 lacks the FID reference that host 0 has: both end before the first step, in one
    line that names host 1 and the file to copy there."""
    hosts = course_hosts(tmp_path, course_data, fid_ref_on=(0,))
    train = course_train(inception_weights)
    codes, outs = two_processes(tmp_path, [train, train], 8, COURSE, hosts)
    line = (f"error: process 1 has no {os.path.join('in100-256/', 'fid_ref.npz')}, the FID "
            f"reference that process 0 has: copy it to that path on process 1's host (FID runs "
            f"on every host), or train without FID (--final-fid 0, no --fid-every)")
    for code, out in zip(codes, outs):
        assert code != 0 and out.splitlines()[-1] == line, out[-3000:]
    assert not any(os.path.exists(host / COURSE_RUN / "checkpoints") for host in hosts)
    assert not os.path.exists(hosts[0] / COURSE_RUN / "metrics.jsonl")

def losses(run_dir):
    return [r["loss"] for r in records(run_dir) if "loss" in r]

def executions(trace_dir, function):
    """How many times the trace under trace_dir called the jit-compiled `function` (read from its
    Perfetto JSON, written beside the .xplane.pb; jax nests a second event in each call's)."""
    [path] = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path) as f:
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in json.load(f)["traceEvents"]
                 if e.get("name") == f"PjitFunction({function})"]
    return sum(not any(a < start <= b for a, b in spans) for start, _ in spans)

@slow
def test_loss_falls_on_mnist(tmp_path):
    """The demo's loss falls within 60 steps; on the way, --profile traces steps 11 to 15."""
    run_dit(tmp_path, ["--dataset", "mnist", "--data-dir", data("mnist"), "--size", "XS", "--patch",
                       "4", "--batch-size", "32", "--steps", "60", "--log-every", "10",
                       "--ckpt-every", "60", "--sample-every", "60", "--sample-steps", "4",
                       "--final-fid", "0", "--lr", "1e-3", "--run-dir", str(tmp_path / "run"),
                       "--profile", str(tmp_path / "profile")])
    loss = losses(tmp_path / "run")
    assert loss[-1] < 0.75 * loss[0], loss
    assert executions(tmp_path / "profile", "train_step") == 5
    grid = np.asarray(Image.open(tmp_path / "run" / "samples" / "step_0000060.png"))
    assert grid.ndim == 2 and grid.shape[0] > 28  # a grayscale grid of several digits
    # FID samples of a grayscale model are stored as RGB, the layout fid.py and OpenAI's evaluator
    # read
    dit.main(["sample", "--ckpt", dit.list_checkpoints(tmp_path / "run")[-1], "--fid", "10",
              "--batch-size", "10", "--steps", "2", "--out", str(tmp_path / "samples.npz")])
    with np.load(tmp_path / "samples.npz") as f:
        images = f["arr_0"]
    assert images.shape == (10, 28, 28, 3) and images.dtype == np.uint8 and images.std() > 0
    assert (images[..., :1] == images).all()

@slow
def test_loss_falls_on_cifar10_photos(tmp_path):
    root = tmp_path / "cifar"
    with tarfile.open(data("cifar10-jpeg.tar.gz")) as tar:
        taken = {}
        for m in tar:
            parts = m.name.split("/")
            if (m.isfile() and len(parts) == 4 and parts[1] == "train"
                    and taken.get(parts[2], 0) < 20):
                taken[parts[2]] = taken.get(parts[2], 0) + 1
                os.makedirs(root / parts[2], exist_ok=True)
                (root / parts[2] / parts[3]).write_bytes(tar.extractfile(m).read())
            if len(taken) == 10 and all(v == 20 for v in taken.values()):
                break
    run_dit(tmp_path, ["--dataset", "folder", "--data-dir", str(root), "--size", "XS", "--patch",
                       "4", "--batch-size", "32", "--steps", "60", "--log-every", "10",
                       "--ckpt-every", "60", "--sample-every", "60", "--sample-steps", "4",
                       "--final-fid", "0", "--lr", "1e-3", "--run-dir", str(tmp_path / "run")])
    loss = losses(tmp_path / "run")
    assert loss[-1] < 0.75 * loss[0], loss
    meta, _ = final_state(tmp_path / "run")
    assert meta["model"]["num_classes"] == 10 and meta["model"]["in_channels"] == 3

@slow
def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, folder_data):
    # From step 5 on, the data holds an infinity: the loss of step 5 is the first that is not
    # finite.
    poison = """
batch = dit.Loader.batch
def poisoned(self, step):
    x, y = batch(self, step)
    if step >= 4:
        x = x.copy(); x[0, 0, 0, 0] = float("inf")
    return x, y
dit.Loader.batch = poisoned
"""
    out = run_dit(tmp_path, train_args(folder_data, tmp_path / "run", 9), patch=poison, check=False)
    assert out.returncode != 0 and "at step 5" in out.stderr
    assert ([os.path.basename(p) for p in dit.list_checkpoints(tmp_path / "run")]
            == ["step_0000003.npz"])
    _, arrays = final_state(tmp_path / "run")
    assert all(np.isfinite(v).all() for v in arrays.values())

@slow
def test_batch_that_does_not_split_over_the_devices_is_refused(tmp_path, folder_data):
    out = run_dit(tmp_path, train_args(folder_data, tmp_path / "run", 2, ["--batch-size", "6"]),
                  devices=4, check=False)
    assert out.returncode != 0 and "does not split over 4 devices" in out.stderr

@slow
@pytest.mark.xdist_group("straight_run")
def test_run_dir_of_another_run_is_refused(tmp_path, folder_data, straight_run):
    out = run_dit(tmp_path, train_args(folder_data, straight_run, 2, ["--objective", "ddpm"]),
                  check=False)
    assert out.returncode != 0 and "holds another run" in out.stderr and "objective" in out.stderr

@slow
@pytest.mark.xdist_group("straight_run")
def test_checkpoint_of_another_model_size_is_refused(straight_run):
    meta, arrays = final_state(straight_run)
    cfg = dit.DiTConfig(**{**meta["model"], "hidden_size": 64, "num_heads": 2})
    tx, _ = dit.make_optimizer(1e-4)
    _, state, shardings = dit.init_state(cfg, tx, 0, dit.make_mesh(), False, jnp.float32, False)
    with pytest.raises(ValueError, match="another model size"):
        dit.restore_state(arrays, state, shardings, "that checkpoint")

@slow
def test_missing_dataset_says_how_to_prepare_it(tmp_path):
    out = run_dit(tmp_path, ["--dataset", "imagenet100", "--data-dir", str(tmp_path / "nowhere"),
                             "--run-dir", str(tmp_path / "run")], check=False)
    assert out.returncode != 0 and "prepare_imagenet100.py" in out.stderr

@slow
def test_dataset_that_changed_since_the_run_began_is_refused(tmp_path, folder_data):
    """The data order, and so an exact resume, depends on the dataset's size."""
    grown = tmp_path / "grown"
    shutil.copytree(folder_data, grown)
    run_dit(tmp_path, train_args(str(grown), tmp_path / "run", 1))
    shutil.copy(grown / "squares" / "0.png", grown / "squares" / "extra.png")
    out = run_dit(tmp_path, train_args(str(grown), tmp_path / "run", 2), check=False)
    assert out.returncode != 0 and "dataset_size: 96 -> 97" in out.stderr

def test_damaged_checkpoint_names_itself_and_the_way_out(tmp_path):
    path = tmp_path / "step_0000001.npz"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError,
                       match="step_0000001.npz is not a readable DiT checkpoint.*delete it"):
        dit.read_checkpoint(str(path))

# --- SLURM: the README's job scripts under a real SLURM ---------------------------
# .ci/run installs Debian's slurm-wlm and munge and starts a controller and a node daemon on this
# machine. Each test runs a README script as a user would submit it, at a tiny size on the CPU: the
# GPU's #SBATCH line dropped, dit.py's arguments replaced by the tests' tiny model's.

@pytest.fixture(scope="module")
def slurm():
    """A SLURM that answers; where none is installed the tests skip, but never in CI."""
    if not shutil.which("sbatch"):
        if os.environ.get("CI"):
            pytest.fail("CI must run the SLURM tests, but sbatch is not installed (.ci/run "
                        "installs slurm-wlm)")
        pytest.skip("no SLURM here: .ci/run installs Debian's slurm-wlm and starts it")
    answer = subprocess.run(["sinfo", "--noheader", "--format", "%T"], capture_output=True,
                            text=True)
    assert answer.returncode == 0 and {"idle", "mixed"} & set(answer.stdout.split()), (
        f"SLURM is installed but its node is not up (.ci/run starts it): {answer.stdout}"
        f"{answer.stderr}")

def readme_job_script(name):
    """The README's job script whose #SBATCH --job-name is `name`."""
    text = open(os.path.join(HERE, "README.md")).read()
    return next(block for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                if f"--job-name={name} " in block)

def tiny_job(tmp_path, name, args, patch="", replace=()):
    """The README's job script `name` at a tiny size, as a file in tmp_path: the GPU's #SBATCH
    line dropped, paths in tmp_path, and dit.py's arguments up to --run-dir replaced by `args`
    (a driver that trains the tiny model, as run_dit's)."""
    driver = tmp_path / "driver.py"
    driver.write_text(driver_text(patch))
    script = readme_job_script(name)
    script = re.sub(r"^#SBATCH --partition=gpu.*\n|^source .*\n", "", script, flags=re.M)
    script = script.replace("/scratch/network/$USER", str(tmp_path))
    script, found = re.subn(r"python dit\.py .*? --run-dir",
                            f"{sys.executable} {driver} {shlex.join(args)} --run-dir", script)
    assert found == 1, script
    for old, new in replace:
        assert old in script, old
        script = script.replace(old, new)
    path = tmp_path / f"{name}.sh"
    path.write_text(script)
    return path

def job_args(data_dir, steps, extra=()):
    """train_args of the tiny model without --run-dir, which the job scripts give."""
    args = train_args(data_dir, "", steps, extra)
    i = args.index("--run-dir")
    return args[:i] + args[i + 2:]

def sbatch(path, *options):
    """Submit a job script from its folder, with this process's environment (one CPU device,
    the tests' compilation cache): its job id."""
    out = subprocess.run(["sbatch", "--parsable", *options, str(path)], cwd=path.parent,
                         env=process_env(1), capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]

def wait_for_jobs(name, timeout=900):
    """Until no job named `name` is queued or running."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "--noheader", "--name", name, "--format", "%i"],
                         capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"jobs {name} still queued after {timeout} s"
        time.sleep(1)

def job_output(tmp_path, name, job):
    return (tmp_path / f"{name}-{job}.out").read_text()

# In a job whose environment sets SLOW_STEPS, 0.1 s more a step, in the loop itself (the loader's
# thread would hide it), so that the jobs' stops, which come tens of seconds apart, fall mid-run.
SLOW_STEPS = """
import time
reason = dit.Stop.reason
def slow_reason(self, done):
    time.sleep(0.1)
    return reason(self, done)
if os.environ.get("SLOW_STEPS"):
    dit.Stop.reason = slow_reason
"""

@slow
@one_slurm
def test_slurm_chain_outlives_each_way_a_job_ends_and_is_the_uninterrupted_run(tmp_path, slurm,
                                                                              folder_data):
    """The README's train.sh, five jobs of one chain (`--dependency=singleton`): the first ended by
    `scancel` (SIGTERM), the second by `--signal=USR1@100`'s warning, the third by its time limit
    (the run stops itself before it), the fourth finishes the run, the fifth finds it finished and
    ends at once. Each stop leaves a checkpoint and says so; the run ends bit for bit as the run
    that was never stopped, its history whole, and `report` reads it as one run."""
    steps, name = 1200, f"dit-chain-{os.getpid()}"
    args = job_args(folder_data, steps, ["--ckpt-every", "100000", "--keep", "10"])
    straight = tmp_path / "straight"
    run_dit(tmp_path, [*args, "--run-dir", str(straight)])
    script = tiny_job(tmp_path, "dit-S2-in100", args, patch=SLOW_STEPS,
                      replace=[("dit-S2-in100", name)])
    run = tmp_path / "runs" / "in100-S2"
    # SLURM sends --signal's warning up to a minute before the time asked: at 20 to 80 s into
    # the second job, whose own stop would come at 90 s; at 59 s or later into the third, which
    # stops itself at 30 s.
    slow = "--export=ALL,SLOW_STEPS=1"
    jobs = [sbatch(script, slow, "--time=10"),
            sbatch(script, slow, "--time=3", "--signal=USR1@100"),
            sbatch(script, slow, "--time=2", "--signal=USR1@1"),
            sbatch(script, "--time=10"), sbatch(script, "--time=10")]
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() or len(records(run)) < 3:
        assert time.monotonic() < deadline, "the first job logged no steps"
        time.sleep(0.5)
    subprocess.run(["scancel", jobs[0]], check=True)
    wait_for_jobs(name)
    outs = [job_output(tmp_path, name, job) for job in jobs]
    ends = ["interrupted", "interrupted", "reached the SLURM job's end"]
    saved = []
    for out, end in zip(outs, ends):
        # not at a line's start: srun forwards stdout and stderr apart, and may write a line of one
        # inside the bar's line of the other (carriage returns, no newline until the bar closes)
        match = re.search(rf"{end} at step (\d+) of {steps}: saved (\S+);", out)
        assert match, out[-3000:]
        saved.append(int(match[1]))
        assert int(dit.read_checkpoint(match[2], names=[])[0]["step"]) == saved[-1]
    assert 0 < saved[0] < saved[1] < saved[2] < steps, saved
    assert "SLURM job" in outs[2] and "the run stops with a checkpoint" in outs[2]
    assert f"finished {steps} steps" in outs[3], outs[3][-3000:]
    assert outs[4] == ""  # the run was finished: the job ended before python started
    a, b = final_state(straight)[1], final_state(run)[1]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert [r["step"] for r in records(run) if "loss" in r] == list(range(1, steps + 1))
    table = open(dit.main(["report", str(run), "--out", str(tmp_path / "report")]).markdown).read()
    assert table.count(str(run)) == 1 and f"| {steps:,} |" in table, table

@slow
@one_slurm
def test_srun_with_two_tasks_trains_one_run_over_two_processes(tmp_path, slurm, folder_data,
                                                              straight_run):
    """`srun --ntasks=2`: jax.distributed joins the two tasks from SLURM's variables, each with
    one CPU device and half of each batch, into one run equal to one process's."""
    run_dir, driver = tmp_path / "run", tmp_path / "driver.py"
    driver.write_text(driver_text())
    out = subprocess.run(["srun", "--ntasks=2", "--cpus-per-task=1", "--time=5", sys.executable,
                          str(driver), *train_args(folder_data, run_dir, 3, VALIDATION)],
                         cwd=tmp_path, env=process_env(1), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 devices, 2 processes" in out.stdout
    assert_states_close(state_at(straight_run, 3), final_state(run_dir)[1])

@slow
@one_slurm
def test_slurm_job_array_sweeps_settings_into_a_report_of_its_runs(tmp_path, slurm, folder_data):
    """The README's sweep.sh as a job array of three settings: a run directory each, and a
    report of the three runs, each labelled by the setting in which it differs."""
    name = f"dit-sweep-{os.getpid()}"
    script = tiny_job(tmp_path, "dit-sweep", job_args(folder_data, 4), replace=[
        ("dit-sweep", name),
        ('SETTINGS=("--lr 1e-4" "--lr 2e-4" "--lr 2e-4 --ema-decay 0.999" "--objective ddpm" '
         '"--arch dit+")', 'SETTINGS=("--lr 1e-3" "--lr 2e-3" "--lr 2e-3 --ema-decay 0.99")')])
    sbatch(script, "--array=0-2", "--wait")
    runs = [str(tmp_path / "runs" / "sweep" / str(k)) for k in range(3)]
    for run in runs:
        assert [r["step"] for r in records(run) if "loss" in r] == [1, 2, 3, 4], run
    table = open(dit.main(["report", *runs, "--out", str(tmp_path / "report")]).markdown).read()
    for run in runs:
        assert table.count(run) == 1
    for label in ("--lr 0.001 --ema-decay 0.9", "--lr 0.002 --ema-decay 0.9",
                  "--lr 0.002 --ema-decay 0.99"):
        assert f"`{label}`" in table, table

#################################################################################
#                          13. Sampling and evaluation                          #
#################################################################################

@slow
def test_export_sample_and_fid_samples(tmp_path, folder_data):
    run_dir = tmp_path / "run"
    run_dit(tmp_path, train_args(folder_data, run_dir, 3))
    ckpt = dit.list_checkpoints(run_dir)[-1]
    # the exported EMA weights give the same model as the checkpoint's EMA
    m1, obj1, _ = dit.load_model(ckpt)
    m2, obj2, _ = dit.load_model(str(run_dir / "ema.safetensors"))
    x, t, y = (jax.random.normal(jax.random.key(0), (2, 8, 8, 3)), jnp.array([10.0, 900.0]),
               jnp.array([0, 1]))
    assert type(obj1) is type(obj2) is dit.RectifiedFlow and vars(obj1) == vars(obj2)
    np.testing.assert_array_equal(np.asarray(m1(x, t, y)), np.asarray(m2(x, t, y)))
    _, arrays = dit.read_checkpoint(ckpt)
    np.testing.assert_array_equal(np.asarray(m1.blocks[1].mlp.fc2.kernel[...]),
                                  arrays["ema.blocks.1.mlp.fc2.kernel"])
    # a grid, and FID samples with labels spread evenly over the classes
    run_dit(tmp_path, ["sample", "--ckpt", ckpt, "--steps", "3", "--n", "4", "--out",
                       str(tmp_path / "g.png"), "--gif", str(tmp_path / "g.gif")], devices=2)
    assert Image.open(tmp_path / "g.png").size == (2 * 10 + 2, 2 * 10 + 2)
    assert Image.open(tmp_path / "g.gif").n_frames > 3
    # on the 8 devices of a TPU v3-8, one sample each, the last batch padded
    run_dit(tmp_path, ["sample", "--ckpt", ckpt, "--steps", "3", "--fid", "10", "--batch-size", "8",
                       "--out", str(tmp_path / "s.npz")], devices=8)
    with np.load(tmp_path / "s.npz") as f:
        assert f["arr_0"].shape == (10, 8, 8, 3) and f["arr_0"].dtype == np.uint8
        assert np.bincount(f["labels"]).tolist() == [5, 5]

@slow
@pytest.mark.xdist_group("straight_run")
def test_training_fid_and_sample_fid_score_the_same_samples(tmp_path, folder_data, monkeypatch,
                                                            straight_run):
    """A run's final FID and `sample --fid` of its EMA weights, at the same guidance (the setting a
    sweep chose: a CFG scale, its interval, a guide and its weight), steps, batch and seed, feed the
    Inception the same images and log the same fields (dit.sample_and_score)."""
    ref = tmp_path / "ref.npz"
    np.savez(ref, mu=np.zeros(4), sigma=np.eye(4))
    monkeypatch.setattr(fid, "load_inception", lambda *args, **kwargs: None)
    monkeypatch.setitem(dit.DIT_SIZES, "XS", TINY_XS)
    fed = []

    def scores(images, ref, inception):
        fed.append(images)
        return {"count": len(images), "protocol": ref["protocol"], "fid": float(images.mean()),
                "sfid": None, "inception_score": 1.0, "inception_score_std": 0.0,
                "precision": None, "recall": None}
    monkeypatch.setattr(fid, "evaluate", scores)
    run_dir, guide = tmp_path / "run", str(straight_run / "ema" / "step_0000003.safetensors")
    dit.main(train_args(folder_data, run_dir, 3, [
        "--final-fid", "6", "--fid-ref", str(ref), "--fid-cfg-scale", "2",
        "--fid-guidance-interval", "0", "700", "--fid-guide", guide, "--fid-guide-scale", "3"]))
    dit.main(["sample", "--ckpt", str(run_dir / "ema.safetensors"), "--fid", "6", "--steps", "2",
              "--batch-size", "8", "--ref", str(ref), "--out", str(tmp_path / "s.npz"),
              "--cfg-scale", "2", "--guidance-interval", "0", "700", "--guide", guide,
              "--guide-scale", "3"])
    assert len(fed) == 2 and fed[0].shape == (6, 8, 8, 3) and fed[0].std() > 0
    # the same weights, run as training's state and as the exported model: float rounding apart
    assert np.abs(fed[0].astype(int) - fed[1]).max() <= 1
    train_fid, sample_fid = [r for r in records(run_dir) if "fid" in r]
    assert "cfg_scale" not in train_fid and sample_fid["cfg_scale"] == 2
    assert sample_fid["guide"] == guide and sample_fid["guide_scale"] == 3
    assert {k: v for k, v in sample_fid.items() if k in train_fid} == {
        **train_fid, "fid": sample_fid["fid"]}
    assert sample_fid["fid"] == pytest.approx(train_fid["fid"], abs=0.01)

@slow
def test_sampler_decodes_each_devices_share_in_chunks(tmp_path):
    """Over 2 devices, 7 latents each, 3 at a time (two chunks and a remainder of 1): the images of
    decoding the whole batch at once. The decoder's working memory (XLA's count) stays that of one
    chunk at 4 times the batch."""
    script = f"""
import json, sys, time, jax, jax.numpy as jnp, numpy as np
from flax import nnx
sys.path.insert(0, {HERE!r})
import dit
assert jax.device_count() == 2
dit.DECODE_CHUNK = 3
vae = dit.load_vae({fixture("vae_reference")!r})
cfg = dit.DiTConfig(input_size=16, hidden_size=32, depth=1, num_heads=2)  # not run here
graphdef = nnx.graphdef(nnx.eval_shape(lambda: dit.DiT(cfg, rngs=nnx.Rngs(0))))
sampler = dit.Sampler(graphdef, dit.make_objective("rf"), dit.make_mesh(), steps=1,
                      method="euler", cfg_scale=1.0, vae=vae, latent_scale=0.5)
chunked = lambda z: sampler.finish(sampler.vae_params, z)
whole = lambda z: dit.to_uint8(vae.decode(z / 0.5))
x = jax.random.normal(jax.random.key(0), (14, 16, 16, 4))  # (B, h, w, latent)
def compile(fn, n):
    return jax.jit(fn).lower(jax.ShapeDtypeStruct((n, 16, 16, 4), jnp.float32)).compile()
for name, fn in (("chunked", chunked), ("whole", whole)):
    np.save({str(tmp_path)!r} + f"/{{name}}.npy", np.asarray(compile(fn, len(x))(x)))
# working memory in bytes at 14 and at 56 latents
print(json.dumps([compile(chunked, n).memory_analysis().temp_size_in_bytes for n in (14, 56)]))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300,
                         capture_output=True, text=True).stdout
    chunked, whole = np.load(tmp_path / "chunked.npy"), np.load(tmp_path / "whole.npy")
    assert chunked.shape == (14, 32, 32, 3) and chunked.std() > 0
    # float32 sums taken in another order may round a value across an integer, rarely
    diff = np.abs(chunked.astype(int) - whole)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (diff > 0).sum()
    temp = json.loads(out.splitlines()[-1])
    assert temp[1] < 1.2 * temp[0], temp

def test_guidance_scales_share_one_compiled_sampler():
    """A sweep's CFG scales, and its decoder, share one compiled program each, whose samples at
    each scale are sample()'s with the scale fixed; unguided sampling has a program of its own."""
    cfg, objective = tiny_config("rf"), dit.make_objective("rf")
    model = dit.DiT(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)  # off adaLN-Zero's start, where labels change no output
    graphdef, params = nnx.graphdef(model), jax.tree.map(
        lambda a: a + 0.1 * rng.standard_normal(a.shape, np.float32), nnx.state(model, nnx.Param))
    samplers = [dit.Sampler(graphdef, objective, dit.make_mesh(), steps=2, method="heun",
                            cfg_scale=scale) for scale in (1.0, 1.5, 4.0)]
    assert samplers[1].run is samplers[2].run is not samplers[0].run
    assert samplers[0].finish is samplers[1].finish is samplers[2].finish
    noise = jax.random.normal(jax.random.key(1), (4, 8, 8, 4))
    y, key = jnp.array([0, 1, 2, 0]), jax.random.key(2)
    outs = [sampler.run(params, None, noise, y, key, sampler.cfg_scale) for sampler in samplers]
    for sampler, out in zip(samplers, outs):
        fixed = jax.jit(lambda params: dit.sample(
            nnx.merge(graphdef, params), objective, noise, y, key, steps=2, method="heun",
            cfg_scale=float(sampler.cfg_scale)))
        np.testing.assert_array_equal(out, fixed(params))
    assert samplers[1].run._cache_size() == 1
    assert not np.array_equal(outs[1], outs[2])

#################################################################################
#                                 14. Benchmark                                 #
#################################################################################

@slow
def test_bench_reports_figures(tmp_path):
    """The figures bench prints agree with each other: images/s is the batch over the time of a
    step, MFU the model's FLOP/s over the peak of every device (the CPU's given one here), the
    hours of 100K and 400K steps those of the step's time, FID-N's phases add up to its total, N
    over the total is its images/s; the traces hold the timed steps and not the compiling one."""
    profile = tmp_path / "profile"
    out = run_dit(tmp_path, ["bench", "--size", "XS", "--patch", "2", "--image-size", "4",
                             "--batch-size", "4", "--precision", "fp32", "--steps", "2", "--fid",
                             "6", "--profile", str(profile), "--mask-ratio", "0.5",
                             "--mixer-depth", "1", "--dispersive"], devices=2,
                  patch='dit.PEAK_FLOPS["cpu"] = 1e9')
    lines = {line.split(":")[0].strip(): line for line in out.stdout.splitlines()}
    cfg = dit.DiTConfig(input_size=4, patch_size=2, in_channels=4, num_classes=1000,
                        learn_sigma=False,  # rf's output
                        hidden_size=32, depth=2, num_heads=2)  # the DRIVER's XS
    step_seconds = {}
    for name, flops in [("train", 3 * dit.dit_flops(cfg) * 4), ("masked", None),
                        ("dispersive", None), ("forward", dit.dit_flops(cfg) * 4)]:
        figures = {unit: float(value) for value, unit in
                   re.findall(r"([\d.]+) (s|ms/step|images/s|TFLOP/s)", lines[name])}
        assert figures["s"] > 0 and figures["ms/step"] > 0, lines[name]
        # ms/step and images/s are printed to 0.1: 4000 / images/s is off by up to 200 / images/s²
        assert figures["ms/step"] == pytest.approx(1000 * 4 / figures["images/s"],
                                                   abs=0.051 + 200.5 / figures["images/s"] ** 2)
        step_seconds[name] = figures["ms/step"] / 1000
        if flops:  # MFU is printed to 0.1%, from a step time that ms/step rounds to 0.05 ms
            mfu = 100 * flops / step_seconds[name] / (1e9 * 2)
            assert float(re.search(r"MFU ([\d.]+)%", lines[name])[1]) == pytest.approx(
                mfu, abs=0.051 + mfu * 0.00005 / (step_seconds[name] - 0.00005))
    hours = [float(h) for h in re.findall(r"\d+K steps ([\d.]+) h", lines["hours"])]
    assert len(hours) == 4, lines["hours"]
    for h, (steps, name) in zip(hours, [(100_000, "train"), (400_000, "train"),
                                        (100_000, "masked"), (400_000, "masked")]):
        # hours printed to 0.1, the step's seconds to 0.0001
        assert h == pytest.approx(steps * step_seconds[name] / 3600, abs=0.051 + steps / 7.2e7)
    assert "the backbone on 2 of 4 tokens" in lines["masked"]
    ratio = float(re.search(r"([\d.]+)x the step without it", lines["dispersive"])[1])
    a, b = step_seconds["dispersive"], step_seconds["train"]  # each rounded to 0.05 ms
    assert ratio == pytest.approx(a / b, abs=0.006 + a / b * (5e-5 / a + 5e-5 / b))
    [fid_line] = [line for name, line in lines.items() if name.startswith("FID-6")]
    assert "32x32 images" in fid_line  # the SD VAE's 8x upsampling of the 4x4 latents
    seconds = {name: float(value) for name, value in re.findall(r"(\w+) ([\d.]+) s\b", fid_line)}
    phases = [seconds["sample"], seconds["decode"], seconds["Inception"],
              seconds["precision_recall"]]
    assert min(phases) > 0 and sum(phases) <= seconds["total"] + 0.002
    assert seconds["total"] - sum(phases) < 0.1 * seconds["total"]
    images_per_s = float(re.search(r"([\d.]+) images/s", fid_line).group(1))
    # images/s is printed to 0.01 and the total to 0.001 s, whose rounding moves 6 / total too
    assert images_per_s == pytest.approx(6 / seconds["total"],
                                         abs=0.005 + 6 * 0.0005 / (seconds["total"] - 0.0005) ** 2)
    assert executions(profile / "train", "train_step") == 2
    assert executions(profile / "masked", "train_step") == 2
    assert executions(profile / "dispersive", "train_step") == 2
    assert executions(profile / "forward", "<lambda>") == 2
    assert glob.glob(str(profile / "fid" / "plugins" / "profile" / "*" / "*.xplane.pb"))

def test_flops_match_the_paper():
    """Table 4 of the paper gives forward Gflops (multiply-adds) of the twelve models at 256x256."""
    paper = {"S/8": 0.36, "S/4": 1.41, "S/2": 6.06, "B/8": 1.42, "B/4": 5.56, "B/2": 23.01,
             "L/8": 5.01, "L/4": 19.70, "L/2": 80.71, "XL/8": 7.39, "XL/4": 29.05, "XL/2": 118.64}
    for name, gflops in paper.items():
        size, patch = name.split("/")
        cfg = dit.DiTConfig(patch_size=int(patch), **dit.DIT_SIZES[size])
        assert dit.dit_flops(cfg) / 2e9 == pytest.approx(gflops, rel=0.01), name

def test_mfu_divides_by_the_peak_of_one_jax_device():
    """bench multiplies a device's peak by jax.device_count(). On TPU v2 and v3 a JAX device is one
    of a chip's two cores, half the chip's dense bfloat16 peak (v2: 45 TFLOP/s, v3: 123); a v4,
    v5e, v5p or v6e device is a chip (275, 197, 459, 918). TPUs go by their exact device_kind,
    where v5e's "TPU v5 lite" and v5p's "TPU v5" differ; GPUs by the name in theirs."""
    def peak(platform, kind):
        return dit.peak_flops(types.SimpleNamespace(platform=platform, device_kind=kind))
    assert peak("tpu", "TPU v2") == 45e12 / 2 and peak("tpu", "TPU v3") == 123e12 / 2
    assert peak("tpu", "TPU v4") == 275e12
    assert peak("tpu", "TPU v5 lite") == peak("tpu", "TPU v5e") == 197e12
    assert peak("tpu", "TPU v5") == peak("tpu", "TPU v5p") == 459e12
    assert peak("tpu", "TPU v6 lite") == 918e12
    assert peak("gpu", "NVIDIA H100 80GB HBM3") == 989e12
    assert peak("tpu", "TPU v4 lite") is None and peak("cpu", "cpu") is None

@slow
def test_compiled_training_step_costs_what_dit_flops_counts():
    """XLA's cost analysis of DiT-S/2's training step, compiled on the CPU and not run, agrees with
    dit_flops within 5%: three forward passes (the backward pass costs two) of 12.1 GFLOP, 36.3 a
    training image. XLA counts about 1% more (1.3% at batch 4): the elementwise work that dit_flops
    leaves out as the paper does (normalisations, GELU, softmax, modulation, the loss), and AdamW's
    and the EMA's updates, once a step whatever the batch."""
    cfg = dit.DiTConfig(patch_size=2, **dit.DIT_SIZES["S"], learn_sigma=False)
    assert dit.dit_flops(cfg) / 1e9 == pytest.approx(12.1, abs=0.05)
    mesh, (tx, _) = dit.make_mesh(), dit.make_optimizer(1e-4)
    graphdef, state, shardings, _ = traced_init_state(cfg, tx, mesh, False, jnp.float32, None)
    batch, split = 4 * jax.device_count(), NamedSharding(mesh, P("data"))
    x, y = spec((batch, 32, 32, 4), sharding=split), spec((batch,), jnp.int32, sharding=split)
    step = dit.jit_train_step(graphdef, dit.make_objective("rf"), tx, 0.9999, False, 0, mesh,
                              shardings)
    flops = step.lower(state, x, y).compile().cost_analysis()["flops"]
    assert flops / batch / 1e9 == pytest.approx(36.3, rel=0.05)
    assert flops / (3 * dit.dit_flops(cfg) * batch) == pytest.approx(1.0, rel=0.05)

#################################################################################
#                                  15. Reports                                  #
#################################################################################
# Synthetic run directories as train leaves them (run.json, metrics.jsonl at a recipe's cadence,
# grids): the figure and the table must show exactly what they hold.

# run.json of `python dit.py --dataset imagenet100 --val-images 1000`
IN100_RUN = {"dataset": "imagenet100", "size": "S", "patch": 2, "arch": "dit", "qk_norm": False,
             "rms_norm": False, "swiglu": False, "rope": False, "objective": "rf",
             "timestep_sampling": "logit_normal", "ln_loc": 0.0, "ln_scale": 1.0,
             "batch_size": 256, "lr": 0.0001, "betas": [0.9, 0.999], "warmup": 0,
             "grad_clip": 0.0, "ema_decay": 0.9999, "ema_warmup": False, "seed": 0,
             "resolution": None, "val_images": 1000, "dataset_size": 125689, "num_classes": 100,
             "masking": None}

def synthetic_run(run_dir, steps, draw=0, log_every=100, val_every=10_000, fid_every=50_000,
                  cut=False, **settings):
    """A run directory of `steps` steps logged as the imagenet100 recipe logs them (a record every
    100 steps, the validation loss every 10,000, FID-5K every 50,000, FID-10K at the end), with
    the loss falling (noise drawn by `draw`), and grids; with `cut`, a last line cut short as by a
    kill. Its records."""
    rng = np.random.default_rng(draw)
    os.makedirs(run_dir / "samples")
    (run_dir / "run.json").write_text(json.dumps({**IN100_RUN, **settings}, indent=1))
    records = []
    for step in range(log_every, steps + 1, log_every):
        seconds = float(rng.uniform(0.4, 0.6))
        loss = float(0.15 + 0.5 / (1 + step / 2000) + 0.01 * rng.standard_normal())
        records.append({"step": step, "loss": loss, "grad_norm": 0.5,
                        "loss_t": {"0.00-0.25": loss, "0.25-0.50": loss, "0.50-0.75": loss,
                                   "0.75-1.00": loss},
                        "lr": 1e-4, "images_per_s": 256 / seconds, "s_per_step": seconds})
        if step % val_every == 0:
            levels = (0.2 + 0.4 / (1 + step / 3000)) * np.array([1.4, 0.8, 0.75, 1.0])
            records.append({"step": step, "val_loss": float(levels.mean()),
                            "val_loss_t": dict(zip(["0.125", "0.375", "0.625", "0.875"],
                                                   levels.tolist()))})
        for n, due in ((5000, step % fid_every == 0), (10000, step == steps)):
            if due:
                records.append({"step": step, "fid_samples": n, "fid_protocol": "adm",
                                "fid": 20 + 400 / (1 + step / 10_000), "sfid": 9.0,
                                "inception_score": 50.0, "precision": 0.6, "recall": 0.4})
    text = "".join(json.dumps(r) + "\n" for r in records)
    if cut:
        text += json.dumps(records[-1] | {"step": steps + log_every})[:40]
    (run_dir / "metrics.jsonl").write_text(text)
    for step in (steps // 2, steps):
        Image.new("RGB", (34, 34)).save(run_dir / "samples" / f"step_{step:07d}.png")
    return records

def panels(figure):
    return {ax.get_title(): ax for ax in figure.axes}

def xy(line):
    return np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)

def test_report_draws_what_the_runs_logged(tmp_path):
    """DiT against DiT+ with deferred masking, the second's last line cut short: each curve is the
    records' figures at their steps; the legend names each run by the options where they differ."""
    dit_run = synthetic_run(tmp_path / "dit", 20_000, fid_every=10_000)
    plus_run = synthetic_run(tmp_path / "plus", 30_000, draw=1, fid_every=10_000, cut=True,
                             arch="dit+", rms_norm=True, swiglu=True, rope=True,
                             masking={"mask_ratio": 0.75, "mixer_depth": 2})
    report = dit.main(["report", str(tmp_path / "dit"), str(tmp_path / "plus"), "--out",
                       str(tmp_path / "report")])
    assert Image.open(report.curves).size[0] > 1000
    assert [t.get_text() for t in report.figure.legends[0].get_texts()] == [
        "--arch dit --mask-ratio 0", "--arch dit+ --mask-ratio 0.75 --mixer-depth 2"]
    axes = panels(report.figure)
    for i, records in enumerate([dit_run, plus_run]):
        train = [r for r in records if "loss" in r]
        val = [r for r in records if "val_loss" in r]
        fids = [r for r in records if r.get("fid_samples") == 5000]
        steps = [r["step"] for r in train]
        raw, smooth = axes["training loss (faint: as logged)"].lines[2 * i:2 * i + 2]
        np.testing.assert_array_equal(xy(raw), [steps, [r["loss"] for r in train]])
        # the trend: the mean of each loss and those before it over 2% of the records
        w = round(0.02 * len(train))
        assert xy(smooth)[1][-1] == pytest.approx(np.mean([r["loss"] for r in train][-w:]))
        assert raw.get_color() == smooth.get_color() == f"C{i}"
        speed = axes["training speed (faint: as logged)"].lines[2 * i]
        np.testing.assert_array_equal(xy(speed), [steps, [r["images_per_s"] for r in train]])
        (line,) = axes["validation loss, mean of the noise levels"].lines[i:i + 1]
        np.testing.assert_array_equal(xy(line), [[r["step"] for r in val],
                                                 [r["val_loss"] for r in val]])
        for t in ("0.125", "0.375", "0.625", "0.875"):
            (line,) = axes[f"validation loss at t = {t}"].lines[i:i + 1]
            np.testing.assert_array_equal(xy(line)[1], [r["val_loss_t"][t] for r in val])
        # FID-5K and FID-10K are two lines, each named by its marker in the panel's legend
        fid_lines = axes["FID during training"].lines[2 * i:2 * i + 2]
        np.testing.assert_array_equal(xy(fid_lines[1]), [[r["step"] for r in fids],
                                                         [r["fid"] for r in fids]])
        assert xy(fid_lines[0])[0].tolist() == [steps[-1]]
    assert [t.get_text() for t in axes["FID during training"].get_legend().get_texts()] == [
        "10K samples, adm", "5K samples, adm"]
    assert axes["training speed (faint: as logged)"].get_ylabel() == "images/s"

def test_report_marks_where_masking_ended(tmp_path):
    """A run's {"unmasked": true} record (--unmask-at) is a marker on the trend of its training
    loss and speed, which the panels' legend names; a run without one has none."""
    synthetic_run(tmp_path / "dit", 20_000)
    synthetic_run(tmp_path / "masked", 30_000, masking={"mask_ratio": 0.75, "mixer_depth": 2})
    with open(tmp_path / "masked" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 25_050, "unmasked": True}) + "\n")
    report = dit.main(["report", str(tmp_path / "dit"), str(tmp_path / "masked"), "--out",
                       str(tmp_path / "report")])
    for title in ("training loss (faint: as logged)", "training speed (faint: as logged)"):
        ax = panels(report.figure)[title]
        assert len(ax.lines) == 5  # each run's as logged and its trend, then the marker
        smooth, marker = ax.lines[3], ax.lines[4]
        assert marker.get_color() == smooth.get_color() == "C1"
        assert xy(marker)[0].tolist() == [25_050]
        assert xy(marker)[1][0] == pytest.approx(np.interp(25_050, *xy(smooth)))
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            "every patch from here (--unmask-at)"]

def test_report_against_hours_of_training(tmp_path):
    """--x hours: each record's step becomes the hours of the logged seconds per step up to it,
    the validation records' as the training records'."""
    dit_run = synthetic_run(tmp_path / "dit", 20_000)
    hours = dit.main(["report", str(tmp_path / "dit"), "--out", str(tmp_path / "hours"), "--x",
                      "hours"])
    train = [r for r in dit_run if "loss" in r]
    raw = panels(hours.figure)["training loss (faint: as logged)"].lines[0]
    seconds = np.cumsum([100 * r["s_per_step"] for r in train])  # a record every 100 steps
    np.testing.assert_allclose(xy(raw)[0], seconds / 3600)
    assert raw.axes.get_xlabel() == "hours of training"
    val = [r for r in dit_run if "val_loss" in r]  # every 10,000 steps: every 100th record
    np.testing.assert_allclose(
        xy(panels(hours.figure)["validation loss, mean of the noise levels"].lines[0])[0],
        seconds[99::100] / 3600)
    assert len(val) == 2

def test_report_table_and_grids(tmp_path):
    """report.md: a row per run with what differs, steps, hours, median images/s, the last and the
    best validation loss, the newest FID with its sample count and protocol; the newest grids,
    linked from the report's folder."""
    records = synthetic_run(tmp_path / "runs" / "a", 20_000)
    synthetic_run(tmp_path / "runs" / "b", 20_000, draw=1, seed=1)
    out = tmp_path / "week 3"
    dit.main(["report", str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "b"), "--out",
              str(out)])
    text = (out / "report.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(f"| {tmp_path}")]
    train = [r for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    hours = sum(100 * r["s_per_step"] for r in train) / 3600
    assert rows[0][1:] == [
        "`--seed 0`", "", "20,000", f"{hours:.2f}",
        f"{np.median([r['images_per_s'] for r in train]):.1f}", f"{val[-1]:.4f}",
        f"{min(val):.4f} at step 20,000", f"{20 + 400 / 3:.2f} (10K samples, adm, step 20,000) |"]
    assert rows[1][1] == "`--seed 1`"
    links = re.findall(r"!\[(.*?)\]\((.*?)\)", text)
    assert links[0] == ("curves", "curves.png")
    assert links[1] == ("--seed 0, step 20,000", "../runs/a/samples/step_0020000.png")
    assert all(os.path.isfile(out / link) for _, link in links)

def test_report_draws_guidance_sweeps(tmp_path):
    """`sample --fid` sweeps in a run's metrics: FID, Precision and Recall against the guidance
    scale, of the newest checkpoint that a sweep scored, a line for each guidance interval."""
    synthetic_run(tmp_path / "run", 20_000)
    sweep = []
    for step, interval, scales in [(10_000, None, [1.0, 2.0]), (20_000, None, [1.5, 1.0, 3.0]),
                                   (20_000, [0, 700], [1.0, 3.0])]:
        for scale in scales:
            sweep.append({"step": step, "cfg_scale": scale, "guidance_interval": interval,
                          "guidance_channels": "all", "sampler": "heun", "sample_steps": 25,
                          "fid_samples": 10_000, "fid_protocol": "adm",
                          "fid": 10 + (scale - 1.6) ** 2, "sfid": 5.0,
                          "inception_score": 40 * scale, "precision": 0.5 + scale / 10,
                          "recall": 0.6 - scale / 10})
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in sweep))
    report = dit.main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    ax = panels(report.figure)["FID by guidance (newest sweep)"]
    whole, interval = ax.lines
    assert xy(whole)[0].tolist() == [1.0, 1.5, 3.0]
    assert xy(whole)[1] == pytest.approx([10 + 0.6 ** 2, 10 + 0.1 ** 2, 10 + 1.4 ** 2])
    assert xy(interval)[0].tolist() == [1.0, 3.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "step 20,000, 10K samples, adm", "step 20,000, 10K samples, adm, CFG in [0, 700]"]
    ax = panels(report.figure)["Precision and Recall by guidance (newest sweep)"]
    precision, recall = ax.lines[:2]
    assert xy(precision)[1] == pytest.approx([0.6, 0.65, 0.8])
    assert xy(recall)[1] == pytest.approx([0.5, 0.45, 0.3])
    # the FID of training is drawn apart from the sweeps'
    np.testing.assert_array_equal(xy(panels(report.figure)["FID during training"].lines[0])[0],
                                  [20_000])

def test_report_names_bad_runs(tmp_path, monkeypatch):
    """A folder that is not a run, a run with no metrics yet (or only a line cut short), a damaged
    run.json: one line each. Runs of different datasets are compared, the legend says which."""
    def refused(message, *runs):
        with pytest.raises(SystemExit) as info:
            dit.run_cli(dit.main, ["report", *map(str, runs), "--out", str(tmp_path / "out")])
        assert "\n" not in info.value.code and re.search(message, info.value.code), info.value
    synthetic_run(tmp_path / "good", 1000)
    refused(re.escape(f"{tmp_path / 'nothing'} is not a run directory: it has no run.json"),
            tmp_path / "good", tmp_path / "nothing")
    os.makedirs(tmp_path / "samples")
    refused("is not a run directory", tmp_path / "samples")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "run.json").write_text(json.dumps(IN100_RUN))
    refused("new has no metrics yet", tmp_path / "new")
    (tmp_path / "new" / "metrics.jsonl").write_text('{"step": 100, "loss": 0.')
    refused("new has no metrics yet", tmp_path / "new")
    (tmp_path / "new" / "run.json").write_text('{"dataset": ')
    refused("run.json is not valid JSON", tmp_path / "new")
    (tmp_path / "new" / "run.json").write_text("[]")
    refused("run.json is not the settings of a run", tmp_path / "new")

    synthetic_run(tmp_path / "cifar", 1000, dataset="cifar10", dataset_size=50_000,
                  num_classes=10, batch_size=128)
    report = dit.main(["report", str(tmp_path / "good"), str(tmp_path / "cifar"), "--out",
                       str(tmp_path / "out")])
    assert [t.get_text() for t in report.figure.legends[0].get_texts()] == [
        "--dataset imagenet100 --batch-size 256 125,689 images 100 classes",
        "--dataset cifar10 --batch-size 128 50,000 images 10 classes"]

    # without matplotlib: report.md, and one line that says what to install
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    os.remove(tmp_path / "out" / "report.md")
    refused(r"wrote .*report.md; curves.png needs matplotlib: pip install matplotlib",
            tmp_path / "good")
    assert "curves.png" not in (tmp_path / "out" / "report.md").read_text()

@slow
def test_report_of_400k_steps_takes_seconds(tmp_path, capsys):
    """Two runs of the imagenet100 recipe's 400K steps, logged at its cadence."""
    for name, arch in [("dit", "dit"), ("dit+", "dit+")]:
        synthetic_run(tmp_path / name, 400_000, arch=arch)
    start = time.perf_counter()
    report = dit.main(["report", str(tmp_path / "dit"), str(tmp_path / "dit+"), "--out",
                       str(tmp_path / "out")])
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\nreport of two runs of 400K steps: {seconds:.2f} s")
    assert len(panels(report.figure)["training loss (faint: as logged)"].lines[0].get_xdata()) \
        == 4000
    assert seconds < 30

def readme_table(heading):
    """The rows (lists of cells) of the first table after the README's line `heading`."""
    with open(os.path.join(HERE, "README.md")) as f:
        text = f.read()
    text = text[text.index(heading):]
    table = re.search(r"((?:^\|.*\|\n)+)", text, re.M)[1].splitlines()
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in table[2:]]

def run_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]

# The README's tables of runs, each row's runs/ folder (its --run-dir), whose run.json and
# metrics.jsonl fixtures/runs holds: the rows' first cells, their options, name them.
README_RUNS = {
    "**The ablation**": {"`--arch dit`": "ablation-dit",
                         "`--arch dit --seed 1`": "ablation-dit-seed1",
                         "`--arch dit+ --qk-norm`": "ablation-dit+-qk-norm",
                         "`--arch dit+`": "ablation-dit+"},
    "**At equal wall-clock**": {"DiT+": "masking-dit+", "masking 0.5": "masked-50",
                                "masking 0.5, then every patch": "masked-50-unmask",
                                "**masking 0.75**": "masked-75",
                                "masking 0.75, then every patch": "masked-75-unmask"},
    "**Judged on CIFAR-10, at equal wall-clock.**": {
        "DiT+": "repr-dit+", "dispersive loss": "repr-dispersive", "SRA": "repr-sra",
        "internal guidance": "repr-internal", "internal guidance and SRA": "repr-pair"},
    "**At a longer budget**": {"DiT+": "long-dit+", "masking 0.75": "long-masked-75",
                               "**masking 0.75, then every patch**": "long-masked-75-unmask"}}

@pytest.mark.parametrize("heading", README_RUNS)
def test_readme_tables_of_runs_are_their_reports(tmp_path, heading):
    """The README's tables of the DiT+ ablation, masking and the representations' terms give the
    validation losses that their runs
    logged (fixtures/runs: each run's run.json and metrics.jsonl), and the figure beside each is
    `report` of those runs: its curves are their records, its legend their differing options."""
    folders = README_RUNS[heading]
    rows = readme_table(heading)
    assert len(rows) == len(folders)
    runs = []
    for row in rows:
        run_dir = fixture(os.path.join("runs", folders[row[0] if row[0] in folders else row[1]]))
        runs.append(run_dir)
        train, val = run_records(run_dir)
        last = val[-1]
        t_cell = row[-2] if heading == "**The ablation**" else row[-1]
        levels = [f"{last['val_loss_t'][t]:.4f}" for t in ("0.125", "0.375", "0.625", "0.875")]
        assert t_cell == " / ".join(levels), row
        if heading == "**The ablation**":  # val_loss at steps 200, 400 and 600
            assert [r["step"] for r in val] == [200, 400, 600]
            assert [c.strip("*") for c in row[3:6]] == [f"{r['val_loss']:.4f}" for r in val], row
            assert row[-1] == f"{train[-1]['loss']:.3f}" and train[-1]["step"] == 600
        else:  # the steps in 20 (80) minutes, then the one more step that logs the validation loss
            assert int(row[2].replace(",", "")) == train[-2]["step"] == last["step"] - 1, row
            assert row[-2].strip("*") == f"{last['val_loss']:.4f}", row
    figure = dit.main(["report", *runs, "--out", str(tmp_path / "report")]).figure
    labels = [t.get_text() for t in figure.legends[0].get_texts()]
    assert len(set(labels)) == len(runs)
    axes = panels(figure)
    for i, run_dir in enumerate(runs):
        train, val = run_records(run_dir)
        np.testing.assert_array_equal(
            xy(axes["validation loss, mean of the noise levels"].lines[i]),
            [[r["step"] for r in val], [r["val_loss"] for r in val]])
        raw = axes["training loss (faint: as logged)"].lines[2 * i]
        np.testing.assert_array_equal(xy(raw)[1], [r["loss"] for r in train])
    with open(os.path.join(HERE, "README.md")) as f:
        readme = f.read()
    after = readme[readme.index(heading):]
    figure_file = re.search(r"!\[[^]]*\]\((fixtures/runs/[^)]+\.png)\)", after)[1]
    assert Image.open(os.path.join(HERE, figure_file)).size == Image.open(
        tmp_path / "report" / "curves.png").size

@slow
@pytest.mark.xdist_group("straight_run")
def test_report_of_a_run_and_its_guidance_sweep(tmp_path, straight_run, monkeypatch, capsys):
    """`sample --fid --ref` on a run's exported weights adds the scores it prints to the run's
    metrics.jsonl at the step the weights were exported from; `report` draws them, and counts the
    parameters of the run's model from its newest checkpoint. A run that cannot be written gets a
    note."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    ref = tmp_path / "ref.npz"
    np.savez(ref, mu=np.zeros(4), sigma=np.eye(4))
    monkeypatch.setattr(fid, "load_inception", lambda *args, **kwargs: None)

    calls = []

    def scores(images, ref, inception):  # figures that differ from call to call
        calls.append(len(images))
        return {"count": len(images), "protocol": ref["protocol"], "fid": 100.0 + len(calls),
                "sfid": None, "inception_score": 1.0, "precision": 0.5, "recall": 0.5}
    monkeypatch.setattr(fid, "evaluate", scores)
    printed = dit.main(["sample", "--ckpt", str(run_dir / "ema.safetensors"), "--fid", "4",
                        "--batch-size", "4", "--steps", "2", "--cfg-scale", "1,3", "--ref",
                        str(ref), "--out", str(tmp_path / "samples.npz")])
    logged = [r for r in records(run_dir) if "cfg_scale" in r]
    assert [(r["step"], r["cfg_scale"], r["fid_samples"]) for r in logged] == [(9, 1, 4), (9, 3, 4)]
    assert [r["fid"] for r in logged] == [printed[f"guidance {s}"]["fid"] for s in (1, 3)] == [
        101, 102]
    report = dit.main(["report", str(run_dir), "--out", str(tmp_path / "out")])
    line = panels(report.figure)["FID by guidance (newest sweep)"].lines[0]
    np.testing.assert_array_equal(xy(line), [[1, 3], [r["fid"] for r in logged]])
    model = dit.load_model(dit.list_checkpoints(run_dir)[-1])[0]
    assert f"| {dit.count_params(model):,} | 9 |" in (tmp_path / "out" / "report.md").read_text()
    # a run folder that cannot be written (a read-only copy): its weights are scored all the same
    temporary_file = tempfile.TemporaryFile

    def read_only_run(*args, dir=None, **kwargs):
        if dir == str(run_dir):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return temporary_file(*args, dir=dir, **kwargs)
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only_run)
    capsys.readouterr()
    printed = dit.main(["sample", "--ckpt", str(run_dir / "ema.safetensors"), "--fid", "4",
                        "--batch-size", "4", "--steps", "2", "--ref", str(ref), "--out",
                        str(tmp_path / "again.npz")])
    assert printed["guidance 1.5"]["fid"] == 103 and records(run_dir)[-1] == logged[-1]
    assert (f"note: cannot write {run_dir / 'metrics.jsonl'}: no file can be made in {run_dir} "
            f"({os.strerror(errno.EROFS)}); the scores are printed only") in capsys.readouterr().out

@slow
@pytest.mark.xdist_group("straight_run")
def test_autoguidance_sweep_by_the_runs_kept_ema(tmp_path, straight_run, monkeypatch):
    """`sample --fid --guide EMA --guide-scale 1,2,3` on a run's weights, guided by the EMA that
    the run kept at step 3: three rows from the same noise (weight 1, the model alone, as without
    a guide), in the run's metrics, and `report` draws FID against the weight."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    ref = tmp_path / "ref.npz"
    np.savez(ref, mu=np.zeros(4), sigma=np.eye(4))
    monkeypatch.setattr(fid, "load_inception", lambda *args, **kwargs: None)
    monkeypatch.setattr(fid, "evaluate", lambda images, ref, inception: {
        "count": len(images), "protocol": ref["protocol"], "fid": float(images.mean()),
        "sfid": None, "inception_score": 1.0, "precision": 0.5, "recall": 0.5})
    guide = str(run_dir / "ema" / "step_0000003.safetensors")
    common = ["sample", "--ckpt", str(run_dir / "ema.safetensors"), "--fid", "4", "--batch-size",
              "4", "--steps", "2", "--cfg-scale", "1.5"]
    printed = dit.main(common + ["--guide", guide, "--guide-scale", "1,2,3", "--ref", str(ref),
                                 "--out", str(tmp_path / "ag.npz")])
    assert list(printed) == ["guidance 1.5"] + [f"guidance 1.5, autoguidance {w} by {guide}"
                                                for w in (2, 3)]
    logged = [r for r in records(run_dir) if "cfg_scale" in r]
    assert [(r["guide"], r["guide_step"], r["guide_scale"]) for r in logged] == [
        (None, None, 1), (guide, 3, 2), (guide, 3, 3)]
    load = lambda name: np.load(tmp_path / name)["arr_0"]  # noqa: E731
    dit.main(common + ["--out", str(tmp_path / "cfg.npz")])
    np.testing.assert_array_equal(load("ag_cfg1.5.npz"), load("cfg.npz"))
    assert (load("ag_cfg1.5_ag2-step_0000003.npz") != load("cfg.npz")).any()
    report = dit.main(["report", str(run_dir), "--out", str(tmp_path / "out")])
    ax = panels(report.figure)["FID by autoguidance (newest sweep)"]
    np.testing.assert_allclose(xy(ax.lines[0]), [[1, 2, 3], [r["fid"] for r in logged]])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "step 9, 4 samples, pytorch-fid, CFG 1.5, guide step_0000003.safetensors"]
    assert xy(panels(report.figure)["FID by guidance (newest sweep)"].lines[0])[0].tolist() == [1.5]

@slow
@pytest.mark.xdist_group("straight_run")
def test_a_guide_that_cannot_guide_is_named_with_the_model(tmp_path, straight_run):
    """A guide of another objective or latent scale (or input, patch or class count) ends the
    command in one line that names both files and what differs, before anything is sampled."""
    meta, arrays = dit.read_checkpoint(dit.list_checkpoints(straight_run)[0])
    meta["objective"], meta["latent_scale"] = {"name": "edm", "sigma_data": 0.5}, 0.18215
    other = tmp_path / "edm.npz"
    np.savez(other, __meta__=np.array(json.dumps(meta)), **arrays)
    model = str(straight_run / "ema.safetensors")
    with pytest.raises(SystemExit) as info:
        dit.run_cli(dit.main, ["sample", "--ckpt", model, "--guide", str(other),
                               "--guide-scale", "2"])
    assert info.value.code == (
        f"error: {other} cannot guide {model}: objective edm (sigma_data 0.5) against rf, latent "
        f"scale 0.18215 against None; a guide is an earlier EMA of the same run (RUN/ema/) or a "
        f"smaller model trained on the same data")
    with pytest.raises(dit.InputError, match="--guide and --guide-scale go together"):
        dit.main(["sample", "--ckpt", model, "--guide", str(other)])
    # two guides of one name would write their samples to one file
    with pytest.raises(dit.InputError, match="two guides are named edm"):
        dit.main(["sample", "--ckpt", model, "--fid", "4", "--guide", str(other), "--guide",
                  str(tmp_path / "b" / "edm.npz"), "--guide-scale", "2"])

@slow
def test_notebook_shows_the_report(kernel, tmp_path):
    """In a notebook, main(["report", ...]) shows curves.png as the cell's output."""
    synthetic_run(tmp_path / "run", 2000)
    assert kernel.paste(os.path.join(HERE, "dit.py")) == ("ok", [])
    status, out = kernel.run(f"main(['report', {str(tmp_path / 'run')!r}, '--out', "
                             f"{str(tmp_path / 'out')!r}])")
    assert status == "ok", out
    shown = base64.b64decode(dict(out)["image/png"])
    assert shown == (tmp_path / "out" / "curves.png").read_bytes()

#################################################################################
#                                16. Command line                               #
#################################################################################

@pytest.mark.parametrize("argv, message", [
    (["--resume"], "--resume: no checkpoint in"),
    (["--profile", "trace"], "--profile traces steps 11 to 15, after step 0 .* ends at step 2"),
    (["--patch", "4", "--resolution", "6"], "--patch 4: the patch size 4 does not divide the input "
                                            "size 6"),
    (["--ln-scale", "0"], "argument --ln-scale: expected a number above 0"),
    (["--mask-ratio", "1"], r"--mask-ratio 1: the share of patches dropped lies in \[0, 1\)"),
    (["--mask-ratio", "0.5", "--mixer-depth", "6"],
     "--mixer-depth 6 leaves none of the model's 6 blocks to the backbone"),
    (["--sra", "--sra-blocks", "2", "1"], "--sra-blocks 2 1: the student block comes before "),
    (["--dispersive", "--dispersive-block", "7"], "--dispersive-block 7: the model has blocks 1 "
                                                  "to 6"),
    (["--internal-guidance", "--internal-block", "6"], "--internal-block 6: the head goes after "
                                                       "one of blocks 1 to 5, before the final"),
    (["sample", "--ckpt", "x.npz", "--fid", "8", "--gif", "x.gif"], "--gif animates a grid"),
    (["export", "--ckpt", "ema.safetensors", "--out", "x.safetensors"],
     r"export takes a training checkpoint \(.npz\)"),
])
@slow
def test_command_line_mistakes_are_named(tmp_path, folder_data, argv, message):
    """A notebook calling main() gets an InputError with the message; the command line prints it
    alone (dit.run_cli)."""
    if argv[0].startswith("--"):  # training options
        argv = train_args(folder_data, tmp_path / "run", 2, argv)
    with pytest.raises(dit.InputError, match=message):
        dit.main(argv)

@pytest.mark.parametrize("argv, least", [
    (["--keep", "0"], 1), (["--log-every", "-1"], 1), (["bench", "--steps", "0"], 1),
    (["sample", "--ckpt", "x.npz", "--n", "0"], 1), (["--warmup", "-1"], 0),
    (["--final-fid", "-10"], 0), (["--val-images", "-8"], 0), (["bench", "--fid", "-1"], 0),
    (["sample", "--ckpt", "x.npz", "--fid", "-5"], 0)])
def test_counts_out_of_range_are_refused_by_the_parser(argv, least):
    """Counts (dit.positive_int) and counts where 0 means none (dit.non_negative_int): the
    parser's InputError, one line, where argparse would print its usage and exit."""
    with pytest.raises(dit.InputError,
                       match=f"argument {argv[-2]}: expected a whole number of at least {least}"):
        dit.main(argv)

@slow
@pytest.mark.xdist_group("straight_run")
def test_sampling_options_the_model_cannot_serve_are_named(tmp_path, straight_run):
    """A rectified-flow model has no DDPM samplers, and a model trained without label dropout no
    null label to guide with: both are refused before sampling."""
    ckpt = dit.list_checkpoints(straight_run)[-1]
    with pytest.raises(dit.InputError, match="--sampler ddim is not a sampler of this model's "
                                             "objective \\(rf\\); use euler or heun"):
        dit.main(["sample", "--ckpt", ckpt, "--sampler", "ddim"])
    with pytest.raises(dit.InputError, match="--internal-scale 2: internal guidance 2: the "
                                             "model has no internal head"):
        dit.main(["sample", "--ckpt", ckpt, "--internal-scale", "2"])
    meta, arrays = dit.read_checkpoint(ckpt)
    meta["model"]["class_dropout_prob"] = 0.0
    table = "ema.y_embedder.embedding_table.embedding"
    arrays[table] = arrays[table][:-1]  # no null row
    np.savez(tmp_path / "no_null.npz", __meta__=np.array(json.dumps(meta)), **arrays)
    with pytest.raises(dit.InputError, match="--cfg-scale 1.5: .* no null label to guide with"):
        dit.main(["sample", "--ckpt", str(tmp_path / "no_null.npz"), "--fid", "4", "--cfg-scale",
                  "1,1.5"])
    with pytest.raises(dit.InputError, match="several --cfg-scale values.*give --fid N"):
        dit.main(["sample", "--ckpt", ckpt, "--cfg-scale", "1,2"])

@slow
@pytest.mark.xdist_group("straight_run")
def test_sample_fid_compares_guidance_settings_from_the_same_noise(tmp_path, straight_run):
    """`sample --fid N --cfg-scale 1.5,4` samples once per scale from the same noise, so each set is
    the one that scale alone gives; without --cfg-scale, FID samples use FID_CFG_SCALE (1.5), not
    the grids' 4."""
    ckpt = dit.list_checkpoints(straight_run)[-1]
    common = ["sample", "--ckpt", ckpt, "--fid", "4", "--batch-size", "4", "--steps", "2"]
    dit.main(common + ["--cfg-scale", "1.5,4", "--out", str(tmp_path / "sweep.npz")])
    dit.main(common + ["--out", str(tmp_path / "default.npz")])
    load = lambda name: np.load(tmp_path / name)["arr_0"]  # noqa: E731
    np.testing.assert_array_equal(load("default.npz"), load("sweep_cfg1.5.npz"))
    assert (load("sweep_cfg4.npz") != load("default.npz")).any()

def began(*args, **kwargs):
    raise AssertionError("the work began before the output path was checked")

@slow
@pytest.mark.xdist_group("straight_run")
def test_every_command_refuses_an_unusable_output_path_before_its_work(tmp_path, folder_data,
                                                                       straight_run, monkeypatch):
    """An output under a regular file (refused to root too), or a file's output that is a folder:
    each command ends in one line naming the user's path, before its work (here `began`); sample
    --fid's folder is made for one setting and for many alike."""
    ckpt, file = dit.list_checkpoints(straight_run)[-1], tmp_path / "file"
    file.write_text("")
    under, folder = str(file / "out" / "x.npz"), str(tmp_path)
    sample = ["sample", "--ckpt", ckpt, "--steps", "2"]
    fid_sample = [*sample, "--fid", "2", "--batch-size", "2"]
    cases = [  # (the call, the path that its message names, the work that must not begin)
        (dit.main, train_args(folder_data, file / "run", 2), file / "run", (dit, "load_dataset")),
        (dit.main, train_args(folder_data, tmp_path / "run", 20, ["--profile", under]), under,
         (dit, "jit_train_step")),
        (dit.main, [*sample, "--out", under], under, (dit.Sampler, "__call__")),
        (dit.main, [*sample, "--out", folder], folder, (dit.Sampler, "__call__")),
        (dit.main, [*sample, "--gif", under], under, (dit.Sampler, "__call__")),
        (dit.main, [*fid_sample, "--out", under], under, (dit.Sampler, "__call__")),
        (dit.main, [*fid_sample, "--out", folder], folder, (dit.Sampler, "__call__")),
        (dit.main, [*fid_sample, "--cfg-scale", "1,2", "--out", under],
         str(file / "out" / "x_cfg1.npz"), (dit.Sampler, "__call__")),
        (dit.main, ["export", "--ckpt", ckpt, "--out", under], under, (dit, "load_model")),
        (dit.main, ["export", "--ckpt", ckpt, "--out", folder], folder, (dit, "load_model")),
        (dit.main, ["report", str(straight_run), "--out", under], under, (dit, "RunRecords")),
        (dit.main, ["report", str(straight_run), "--out", str(file)], str(file),
         (dit, "RunRecords")),
        (dit.main, ["bench", "--size", "XS", "--profile", under], under, (dit, "init_state")),
        (fid.main, ["stats", folder_data, under], under, (fid, "load_images")),
        (fid.main, ["ref", folder_data, folder], folder, (fid, "load_images")),
        (prepare_imagenet100.main, [folder_data, under], under,
         (prepare_imagenet100, "find_images"))]
    for call, argv, path, (owner, work) in cases:
        with monkeypatch.context() as m:
            m.setattr(owner, work, began)
            with pytest.raises(dit.InputError) as e:
                call(argv)
        message = str(e.value)
        assert message.startswith(f"cannot write {path}: "), (argv, message)
        assert ".tmp" not in message and "\n" not in message, message
    dit.main([*fid_sample, "--cfg-scale", "1,2", "--out", str(tmp_path / "new" / "x.npz")])
    assert sorted(os.listdir(tmp_path / "new")) == ["x_cfg1.npz", "x_cfg2.npz"]

def test_parser_built_from_the_configuration_keeps_every_option_and_default():
    """Each command's options and defaults as the release before the configuration dataclasses
    parsed them (fixtures/options_before.json, written by fixtures/options_before.py) are all
    still there, with the same defaults; each option comes from one field of its command's
    configuration."""
    with open(fixture("options_before.json")) as f:
        before = json.load(f)
    commands = next(a for a in dit.build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    assert set(before) <= set(commands) == set(dit.COMMANDS)  # and commands added since
    for name in commands:
        options = before.get(name, {})
        now = {flag: action.default for action in commands[name]._actions
               for flag in action.option_strings if flag not in ("-h", "--help")}
        assert set(options) <= set(now), (name, set(options) - set(now))
        assert {k: json.loads(json.dumps(now[k])) for k in options} == options, name
        fields = {f.name for f in dataclasses.fields(dit.COMMANDS[name])}
        assert {a.dest for a in commands[name]._actions if a.dest != "help"} == fields, name

def test_every_option_says_what_it_does():
    """Each option of each command has its --help text."""
    for name, config_class in dit.COMMANDS.items():
        silent = [f.name for f in dataclasses.fields(config_class) if not f.metadata.get("help")]
        assert not silent, (name, silent)

def readme_commands():
    """The words after `dit.py` of each `python dit.py ...` command in the README: continued lines
    and inline code joined, a shell variable's command (S="python dit.py ...") where it is used
    ($S --ckpt ...), comments, redirections and quotes cut; but for those elided with `...`,
    --help, and a job array's, whose options its tasks pick (${SETTINGS[...]})."""
    with open(os.path.join(HERE, "README.md")) as f:
        parts = f.read().replace("\\\n", " ").split("```")
    # prose (the even parts) with each inline `code` on one line; code blocks as they are
    text = "```".join(re.sub(r"`[^`]*`", lambda m: m[0].replace("\n", " "), part) if i % 2 == 0
                      else part for i, part in enumerate(parts))
    for name, command in re.findall(r'(\w+)="(python3? dit\.py[^"]*)"', text):
        text = re.sub(rf"\${name}\b", lambda _: command, text.replace(f'{name}="{command}"', ""))
    commands = []
    for match in re.finditer(r"python3? dit\.py\b([^`\n]*)", text):
        words = shlex.split(re.split(r"\s#|\s[|>;&]|&&|\$\(|\"", match[1])[0])
        if "..." not in words and "--help" not in words and not any(
                w.startswith("${") for w in words):
            commands.append(words)
    return commands

def test_every_readme_command_parses():
    """Every dit.py command that the README gives parses into its command's configuration."""
    commands = readme_commands()
    assert len(commands) >= 30
    for words in commands:
        config = dit.parse(words)
        assert dataclasses.is_dataclass(config) and type(config) in dit.COMMANDS.values(), words
        assert dit.checked(config) == config, words

def file_digest(path, algorithm):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()

def mnist_stand_ins(monkeypatch):
    """{MNIST's URL: the fixture's test split file that stands in for it}, their md5s published."""
    served = {dit._MNIST_URL + name: data(f"mnist/{name.replace('train', 't10k')}")
              for name in dit._MNIST_MD5}
    monkeypatch.setattr(dit, "_MNIST_MD5", {os.path.basename(url): file_digest(path, "md5")
                                            for url, path in served.items()})
    return served

def offline(url, timeout=None):
    raise urllib.error.URLError("no network")

def test_fetch_fills_the_cache_that_runs_without_network_read(tmp_path, monkeypatch, capsys,
                                                              inception_weights):
    """`dit.py fetch` downloads each file once into $DIT_CACHE (here served from local stand-ins,
    their digests published in place of the real ones), checks them when run again, and refuses
    a damaged one; runs with the network refused then find everything there."""
    cifar, (files, images, _) = tmp_path / "cifar.tar.gz", cifar_files()
    write_cifar_archive(cifar, files)
    vae = fixture("vae_reference")
    served = {f"https://huggingface.co/stabilityai/sd-vae-ft-ema/resolve/main/{name}":
              os.path.join(vae, name) for name in os.listdir(vae)}
    served |= {fid.FID_WEIGHTS_URL: inception_weights, **mnist_stand_ins(monkeypatch),
               dit._CIFAR_URL: str(cifar)}
    monkeypatch.setattr(fid, "FID_WEIGHTS_SHA256", file_digest(inception_weights, "sha256"))
    monkeypatch.setattr(dit, "_CIFAR_MD5", file_digest(cifar, "md5"))
    fetched = []

    def serve(url, timeout=None):
        fetched.append(url)
        with open(served[url], "rb") as f:
            return FakeResponse(f.read())
    monkeypatch.setattr(urllib.request, "urlopen", serve)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DIT_CACHE", str(cache))
    dit.main(["fetch", "--datasets", "mnist", "cifar10"])
    assert sorted(fetched) == sorted(served)
    places = {cache / "sd-vae-ft-ema" / "config.json": "",
              cache / "sd-vae-ft-ema" / "diffusion_pytorch_model.safetensors": "",
              cache / fid.FID_WEIGHTS_NAME: ", sha256 checked",
              cache / "datasets" / "mnist" / "train-images-idx3-ubyte.gz": ", md5 checked",
              cache / "datasets" / "mnist" / "train-labels-idx1-ubyte.gz": ", md5 checked",
              cache / "datasets" / "cifar10" / "cifar-10-python.tar.gz": ", md5 checked"}
    export = f"On machines without network access, run with: export DIT_CACHE={cache}"
    assert capsys.readouterr().out.splitlines() == [f"{path}: downloaded{checked}"
                                                   for path, checked in places.items()] + [export]

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    dit.main(["fetch", "--datasets", "mnist", "cifar10"])
    assert capsys.readouterr().out.splitlines() == [f"{path}: already there{checked}"
                                                   for path, checked in places.items()] + [export]
    ref = np.load(fixture("vae_reference.npz"))
    assert rel_err(load_vae("ema").encode(nhwc(ref["x"]))[0], nhwc(ref["mean"])) < 1e-5
    assert isinstance(fid.load_inception(), fid.InceptionV3)
    np.testing.assert_array_equal(load_dataset("mnist").x[..., 0],
                                  dit.read_idx(data("mnist/t10k-images-idx3-ubyte.gz")))
    np.testing.assert_array_equal(load_dataset("cifar10").x, images)
    (cache / "datasets" / "mnist" / "train-labels-idx1-ubyte.gz").write_bytes(b"damaged")
    with pytest.raises(dit.InputError, match="train-labels-idx1-ubyte.gz: its md5 is .*delete it"):
        dit.main(["fetch", "--vae", "--no-inception"])

def test_fetch_downloads_nothing_the_default_cache_holds(tmp_path, monkeypatch, capsys):
    """Files already in the default cache are checked and named, not downloaded again; without
    $DIT_CACHE, the last line names the default cache. A file it cannot download ends in one line
    that says where to put it."""
    monkeypatch.delenv("DIT_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cache = tmp_path / ".cache" / "dit-jax"
    shutil.copytree(fixture("vae_reference"), cache / "sd-vae-ft-ema")
    (cache / "datasets" / "mnist").mkdir(parents=True)
    for url, path in mnist_stand_ins(monkeypatch).items():
        shutil.copy(path, cache / "datasets" / "mnist" / os.path.basename(url))
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    dit.main(["fetch", "--no-inception"])
    assert capsys.readouterr().out.splitlines() == [
        f"{cache}/sd-vae-ft-ema/config.json: already there",
        f"{cache}/sd-vae-ft-ema/diffusion_pytorch_model.safetensors: already there",
        f"{cache}/datasets/mnist/train-images-idx3-ubyte.gz: already there, md5 checked",
        f"{cache}/datasets/mnist/train-labels-idx1-ubyte.gz: already there, md5 checked",
        f"Runs read the default cache, {cache}: where home folders are not shared, fetch with "
        f"DIT_CACHE set to a shared folder, and export it where runs run"]
    with pytest.raises(FileNotFoundError, match=f"could not download {fid.FID_WEIGHTS_URL} .*"
                                                f"put it at {cache}/{fid.FID_WEIGHTS_NAME}"):
        dit.main(["fetch", "--vae"])

def test_unmask_at_is_a_step_or_a_share_of_the_run():
    """--unmask-at takes a step or a percentage strictly between 0 and 100; else one line."""
    parse = lambda text: dit.parse(["--unmask-at", text]).unmask_at  # noqa: E731
    assert (parse("3"), parse("0"), parse("90%"), parse("12.5%")) == (3, 0, 0.9, 0.125)
    assert dit.checked(dit.TrainConfig(unmask_at=0.9)).unmask_at == 0.9
    for text in ("0%", "100%", "150%", "x%", "-1", "1.5"):
        with pytest.raises(dit.InputError, match=re.escape(
                f"argument --unmask-at: expected a step (at least 0) or a share of the run between "
                f"0% and 100%, e.g. 90%, got {text!r}")):
            dit.main(["--unmask-at", text])

@pytest.mark.parametrize("setting, message", [
    (dict(steps=0), "argument --steps: expected a whole number of at least 1, got '0'"),
    (dict(size="Q"), "argument --size: invalid choice: 'Q'"),
    (dict(lr="fast"), "argument --lr: invalid float value: 'fast'"),
    (dict(seed=None), "argument --seed: invalid int value: 'None'")])
def test_a_configuration_with_a_wrong_value_ends_in_the_command_lines_one_line(setting, message):
    """dit.train(dit.TrainConfig(...)) in a notebook refuses what the command line refuses, in
    the same line, before anything starts."""
    with pytest.raises(dit.InputError, match=re.escape(message)) as e:
        dit.train(dit.TrainConfig(**setting))
    assert "\n" not in dit.one_line(e.value)

def test_docstrings_are_short():
    """The docstrings of dit.py (all but the module's) say what and why in few words; history and
    figures live in the README."""
    tree = ast.parse(open(os.path.join(HERE, "dit.py")).read())
    words = sum(len(ast.get_docstring(node, clean=False).split()) for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and ast.get_docstring(node))
    print(f"dit.py's docstrings: {words} words")
    assert words <= 4000

def test_section_1_defines_no_error_handling():
    """The book opens with the model's configuration: the one-line errors, their IPython hook and
    the version check stand in the command line's section."""
    text = open(os.path.join(HERE, "dit.py")).read()
    banner = lambda title: re.search(rf"^#\s+{title}.*#$", text, re.M).start()  # noqa: E731
    first = text[banner(r"1\. Configuration"):banner(r"2\. Embeddings")]
    assert "class DiTConfig" in first and "DIT_SIZES" in first
    for word in ("try:", "except", "one_line", "_render_traceback_", "check_versions",
                 "SystemExit"):
        assert word not in first, word

#################################################################################
#                  Notebooks: dit.py and fid.py in a real kernel                #
#################################################################################
# A Jupyter kernel (ipykernel, driven through jupyter_client) runs the cells a user would: the text
# of dit.py and fid.py pasted into cells, or the files imported, then main([...]).

class Kernel:
    """A real IPython kernel started in `cwd`, with this process's environment (its compilation
    cache included)."""

    def __init__(self, cwd):
        from jupyter_client.manager import start_new_kernel
        self.manager, self.client = start_new_kernel(
            kernel_name="python3", cwd=str(cwd),
            env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": UNOPTIMISED})

    def run(self, code, timeout=300, interrupt_when=None):
        """(status, [(kind, text)]) of a cell: kind is stdout, stderr, error (its traceback
        lines joined), or a MIME type of the cell's value or of what it displayed. The kernel is
        interrupted, as by the stop button, once `interrupt_when()` is true."""
        msg_id, outputs = self.client.execute(code), []
        deadline = time.monotonic() + timeout
        while True:
            if interrupt_when and interrupt_when():
                self.manager.interrupt_kernel()
                interrupt_when = None
            try:
                msg = self.client.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                assert time.monotonic() < deadline, f"the cell ran past {timeout} s: {outputs}"
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            if kind == "stream":
                outputs.append((content["name"], content["text"]))
            elif kind in ("execute_result", "display_data"):
                outputs.extend(content["data"].items())
            elif kind == "error":
                outputs.append(("error", "\n".join(content["traceback"])))
        reply = self.client.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:  # the replies of earlier requests
            reply = self.client.get_shell_msg(timeout=timeout)
        return reply["content"]["status"], outputs

    def paste(self, path):
        with open(path) as f:
            return self.run(f.read())

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

@pytest.fixture
def kernel(tmp_path):
    """A kernel in an empty folder, where neither dit.py nor fid.py can be imported."""
    k = Kernel(tmp_path)
    yield k
    k.close()

TINY = f'DIT_SIZES["XS"] = {TINY_XS}'

def readme_cells():
    """{number: text} of the Python cells in the README's Notebooks section; the third, one for each
    platform, by the platform's name ("Kaggle", "Colab", "TPU")."""
    with open(os.path.join(HERE, "README.md")) as f:
        text = f.read()
    section = text[text.index("\n## Notebooks"):]
    section = section[:section.index("\n## ", 1)]
    cells = {}
    for cell in re.findall(r"```python\n(.*?)```", section, re.S):
        number, name = re.match(r"# (\d+)\. (\w+)", cell).groups()
        cells[name if number == "3" else int(number)] = cell
    return cells

# google.colab's drive.mount, which makes the folder that it mounts Google Drive in
COLAB = """
import importlib.util, sys, types
if importlib.util.find_spec("google") is None:
    sys.modules["google"] = types.ModuleType("google")
sys.modules["google.colab"] = types.SimpleNamespace(drive=types.SimpleNamespace(
    mount=lambda path: os.makedirs(os.path.join(path, "MyDrive"), exist_ok=True)))
"""

@slow
@pytest.mark.xdist_group("straight_run")
def test_notebook_runs_the_readme_cells(kernel, tmp_path, folder_data, straight_run):
    """The README's notebook cells, with fid.py's and dit.py's text pasted into cells, and the
    platforms' folders in the test's, its data and tiny model. On Kaggle, a saved version's training
    stopped by the stop button ends with a checkpoint and one line; the next version, with the
    output of that one as its read-only input, goes on from there with the run's history and ends
    bit for bit as the command line's uninterrupted run. On Colab the run goes to the mounted
    Drive; neither platform's run hears that its session would delete it. The cell shows a one-line
    summary, sampling shows the grid, and a bad option is one line with the kernel alive. (The FID
    cell needs the real Inception weights.)"""
    cells = readme_cells()
    assert set(cells) == {1, 2, "Kaggle", "Colab", "TPU", 4, 5, 6}
    assert cells[1].startswith("# 1. Install") and cells[2].startswith("# 2. Paste")
    assert kernel.paste(os.path.join(HERE, "fid.py")) == ("ok", [])
    assert kernel.paste(os.path.join(HERE, "dit.py")) == ("ok", [])
    kaggle, content = tmp_path / "kaggle", tmp_path / "content"

    def here(cell):
        """The cell with the test's folders, data, model and options (its own --data-dir and
        --run-dir come after the test's options, and win)."""
        for path, ours in (("/kaggle/input/in100-256", folder_data),
                           ("/content/drive/MyDrive/in100-256", folder_data),
                           ('"in100-256"', repr(folder_data)), ("/kaggle/", f"{kaggle}/"),
                           ("/content/", f"{content}/"),
                           ('"--size", "S", "--dataset", "imagenet100"', "*OPTIONS")):
            cell = cell.replace(path, ours)
        return cell

    settings = (f"{TINY}\nOPTIONS = {train_args(folder_data, None, 9, VALIDATION)!r}\n"
                f"KAGGLE_WORKING, COLAB_DRIVE = {str(kaggle / 'working')!r}, "
                f"{str(content / 'drive')!r}\nos.environ['KAGGLE_KERNEL_RUN_TYPE'] = 'Batch'")
    assert kernel.run(settings)[0] == "ok"
    os.makedirs(kaggle / "working")
    assert kernel.run(here(cells["Kaggle"])) == ("ok", [])
    run_dir = kaggle / "working" / "runs" / "imagenet100-DiT-S-2"

    # A saved version's run, stopped by the stop button while batches come slowly (a second each),
    # once a step is logged.
    slow = ("batch = Loader.batch\n"
            "Loader.batch = lambda self, step: (time.sleep(1), batch(self, step))[1]")
    assert kernel.run(slow)[0] == "ok"
    status, out = kernel.run(here(cells[4]),
                             interrupt_when=lambda: os.path.exists(run_dir / "metrics.jsonl"))
    assert status == "ok" and not [text for kind, text in out if kind == "error"], out
    step = int(re.fullmatch(r"Run\(.*, step=(\d), .*, stopped='interrupted'\)",
                            dict(out)["text/plain"])[1])
    assert 1 <= step < 9
    saved = str(run_dir / "checkpoints" / f"step_{step:07d}.npz")
    stdout = "".join(text for kind, text in out if kind == "stdout")
    assert (f"interrupted at step {step} of 9: saved {saved}; the same command continues from "
            f"there") in stdout and "note:" not in stdout, out

    # The next version: this one's output, read-only in /kaggle/input, and a new /kaggle/working.
    output = kaggle / "input" / "dit-s-2"
    os.makedirs(output.parent)
    shutil.move(kaggle / "working", output)
    os.makedirs(kaggle / "working")
    subprocess.run(["chmod", "-R", "a-w", str(output)], check=True)
    assert kernel.run("Loader.batch = batch")[0] == "ok"
    assert kernel.run(here(cells["Kaggle"])) == ("ok", [])
    status, out = kernel.run(here(cells[4]))
    subprocess.run(["chmod", "-R", "u+w", str(output)], check=True)
    assert status == "ok", out
    assert re.fullmatch(rf"Run\(run_dir='{re.escape(str(run_dir))}', step=9, "
                        rf"loss=\d\.\d+(e-\d+)?, fid=None, stopped=None\)",
                        dict(out)["text/plain"]), out
    stdout = "".join(text for kind, text in out if kind == "stdout")
    assert f"continues {output / 'runs' / 'imagenet100-DiT-S-2'} at step {step}: " in stdout, out
    assert "note:" not in stdout, out
    for name, value in state_at(straight_run, 9).items():
        np.testing.assert_array_equal(state_at(run_dir, 9)[name], value, err_msg=name)
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(1, 10))
    assert ([r for r in records(run_dir) if "val_loss" in r]
            == [r for r in records(straight_run) if "val_loss" in r])
    status, out = kernel.run(here(cells[5]))
    assert status == "ok" and "image/png" in dict(out), out

    # Colab: the data copied from the mounted Drive, the run on it; a run of 3 steps.
    os.makedirs(content)
    assert kernel.run(f"{COLAB}\ndel os.environ['KAGGLE_KERNEL_RUN_TYPE']\n"
                      f"os.environ['COLAB_RELEASE_TAG'] = 'release-colab-1'\n"
                      f"OPTIONS[OPTIONS.index('--steps') + 1] = '3'")[0] == "ok"
    assert kernel.run(here(cells["Colab"])) == ("ok", [])
    status, out = kernel.run(here(cells[4]))
    assert status == "ok" and "note:" not in "".join(text for kind, text in out), out
    assert re.fullmatch(r"Run\(run_dir='.*/content/drive/MyDrive/runs/imagenet100-DiT-S-2', "
                        r"step=3, .*, stopped=None\)", dict(out)["text/plain"]), out
    # A TPU VM: the run beside the notebook
    assert kernel.run(here(cells["TPU"])) == ("ok", [])
    assert kernel.run("print(DATA, RUN, MORE)") == (
        "ok", [("stdout", f"{folder_data} runs/imagenet100-DiT-S-2 []\n")])

    status, out = kernel.run("main(['--size', 'Q'])")
    assert status == "error"
    errors = [text for kind, text in out if kind == "error"]
    assert len(errors) == 1 and "\n" not in errors[0], out
    assert errors[0].startswith("error: argument --size: invalid choice: 'Q'"), errors
    assert kernel.run("print(1 + 1)") == ("ok", [("stdout", "2\n")])

@slow
def test_notebook_dit_pasted_alone(kernel, tmp_path, folder_data):
    """dit.py alone defines everything; a run that needs FID says in one line, before training,
    that it needs fid.py."""
    assert kernel.paste(os.path.join(HERE, "dit.py")) == ("ok", [])
    ref = tmp_path / "ref.npz"
    np.savez(ref, mu=np.zeros(4), sigma=np.eye(4))
    argv = train_args(folder_data, tmp_path / "run", 3,
                      ["--final-fid", "10", "--fid-ref", str(ref)])
    status, out = kernel.run(f"{TINY}\nmain({argv!r})")
    errors = [text for kind, text in out if kind == "error"]
    assert status == "error" and len(errors) == 1 and "\n" not in errors[0], out
    assert errors[0].startswith("error: FID needs fid.py"), errors
    assert not os.path.exists(tmp_path / "run" / "checkpoints")

@slow
def test_notebook_imported(tmp_path, folder_data):
    """Both files beside the notebook, imported: dit.main trains; an error of the user's own cell
    keeps its traceback."""
    k = Kernel(HERE)
    try:
        argv = train_args(folder_data, tmp_path / "run", 3)
        status, out = k.run(f"import dit\ndit.{TINY}\ndit.main({argv!r})")
        assert status == "ok" and dict(out)["text/plain"].startswith("Run(run_dir="), out
        status, out = k.run("open('no such file')")
        assert status == "error" and "Traceback" in dict(out)["error"], out
    finally:
        k.close()

@slow
def test_notebook_trains_by_its_configuration_as_by_the_command_line(tmp_path, folder_data):
    """In a notebook, dit.train(dit.TrainConfig(...)) trains what dit.main([...]) trains, to the
    same checkpoint bit for bit; run.json holds the configuration, which reads back as the one the
    run used."""
    setting = dict(dataset="folder", data_dir=folder_data, resolution=8, size="XS", patch=2,
                   batch_size=8, steps=2, log_every=1, ckpt_every=3, sample_every=1000,
                   sample_steps=2, final_fid=0, run_dir=str(tmp_path / "config"), lr=1e-3,
                   ema_decay=0.9)
    k = Kernel(HERE)
    try:
        status, out = k.run(f"import dit, json\ndit.{TINY}\n"
                            f"run = dit.train(dit.TrainConfig(**{setting!r}))\n"
                            f"dit.main({train_args(folder_data, tmp_path / 'cli', 2)!r})\n"
                            f"record = json.load(open(run.run_dir + '/run.json'))\n"
                            f"run.config == dit.TrainConfig(**{{k: dit.as_tuples(v) for k, v in "
                            f"record.items() if k in dit.TrainConfig.__dataclass_fields__}})")
        assert status == "ok" and dict(out)["text/plain"] == "True", out
    finally:
        k.close()
    (_, by_config), (_, by_main) = final_state(tmp_path / "config"), final_state(tmp_path / "cli")
    assert by_config.keys() == by_main.keys()
    for name in by_config:
        np.testing.assert_array_equal(by_config[name], by_main[name], err_msg=name)
    records = [json.loads((tmp_path / d / "run.json").read_text()) for d in ("config", "cli")]
    assert [{k: v for k, v in r.items() if k != "run_dir"} for r in records][0] == \
        {k: v for k, v in records[1].items() if k != "run_dir"}

#################################################################################
#                                                                               #
#                                     fid.py                                    #
#                                                                               #
#################################################################################

#################################################################################
#                     The restricted reader of PyTorch files                    #
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
    """`cls.__new__(cls)` then `__dict__.update(state)` (NEWOBJ + BUILD), as protocol 2 pickles
    plain objects."""
    def __init__(self, cls, state):
        self.cls, self.state = cls, state

class _Pickled:
    """A pickle made elsewhere, its opcodes placed where a value goes (its PROTO and STOP
    dropped)."""
    def __init__(self, raw):
        self.opcodes = raw[2:-1] if raw[:1] == pickle.PROTO else raw[:-1]

def _emit(x):
    """Pickle opcodes for x, written out by hand so that any global can be named without importing
    it."""
    if isinstance(x, _Global):
        return b"c" + f"{x.module}\n{x.name}\n".encode()
    if isinstance(x, _Call):
        return _emit(x.func) + _emit(tuple(x.args)) + b"R"
    if isinstance(x, _PersistentId):
        return _emit(x.value) + b"Q"
    if isinstance(x, _NewObj):
        return _emit(x.cls) + b")" + b"\x81" + _emit(x.state) + b"b"
    if isinstance(x, _Pickled):
        return x.opcodes
    if isinstance(x, tuple):
        return b"(" + b"".join(_emit(v) for v in x) + b"t"
    if isinstance(x, list):
        return b"](" + b"".join(_emit(v) for v in x) + b"e"
    if isinstance(x, dict):
        return b"}(" + b"".join(_emit(k) + _emit(v) for k, v in x.items()) + b"u"
    # a scalar or string: pickle's own opcodes minus PROTO/STOP
    return pickle.dumps(x, protocol=2)[2:-1]

def _pickle(obj):
    return b"\x80\x02" + _emit(obj) + b"."

def _tensor(storage_name, key, numel, offset, size, stride):
    """What torch writes for one tensor:
    _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())."""
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
    """A DiT-style training checkpoint exercising offsets, strides, shared storages, bf16, int64,
    bool, Namespace."""
    # all exactly representable in bfloat16
    bf16_values = np.array([1.0, -2.5, 0.15625, 2.0 ** 100], np.float32)
    storages = {
        "0": np.arange(24, dtype=np.float32).tobytes(),
        "1": (bf16_values.view(np.uint32) >> 16).astype("<u2").tobytes(),
        "2": np.array([7], "<i8").tobytes(),
        "3": np.array([True, False, True], np.bool_).tobytes(),
    }
    itemsizes = {"0": 4, "1": 2, "2": 8, "3": 1}
    weight = _Call(_Global("torch._utils", "_rebuild_parameter"),
                   _tensor("FloatStorage", "0", 24, 2, (3, 4), (1, 3)), True,
                   _Call(_Global("collections", "OrderedDict")))
    obj = {
        "model": _Call(_Global("collections", "OrderedDict"), [
            # transposed view at offset 2
            ("w", weight),
            ("row", _tensor("FloatStorage", "0", 24, 20, (4,), (1,))),    # shares storage "0"
            ("bf16", _tensor("BFloat16Storage", "1", 4, 0, (2, 2), (2, 1))),
            ("mask", _tensor("BoolStorage", "3", 3, 0, (3,), (1,))),
        ]),
        "opt": {"state": {0: {"step": _tensor("LongStorage", "2", 1, 0, (), ())}},
                "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": [0]}]},
        "args": _NewObj(_Global("argparse", "Namespace"), {"model": "DiT-XL/2", "image_size": 256}),
    }
    expected = {  # name -> (values, dtype)
        # offset + i*stride0 + j*stride1
        "w": (2 + np.arange(3)[:, None] + 3 * np.arange(4)[None, :], np.float32),
        "row": (np.arange(20, 24), np.float32),
        "bf16": (bf16_values.reshape(2, 2), np.float32),  # bfloat16 comes back widened to float32
        "mask": (np.array([True, False, True]), np.bool_),
    }
    return obj, storages, itemsizes, expected

@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_torch_handbuilt_checkpoint(tmp_path, fmt):
    obj, storages, itemsizes, expected = _handbuilt_checkpoint()
    path = str(tmp_path / "ckpt.pt")
    (_write_zip(path, obj, storages) if fmt == "zip"
     else _write_legacy(path, obj, storages, itemsizes))
    if fmt == "legacy":  # only fid.py reads it, for pytorch-fid's weights; dit.py says so
        _refused(dit.load_torch, path, "legacy format .*, which only fid.py reads")
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
    sd = dit.load_torch(fixture("dit_reference.pt"))
    config = json.loads(str(np.load(fixture("dit_reference.npz"))["config"]))
    hidden, p, c = config["hidden_size"], config["patch_size"], config["in_channels"]
    assert sd["x_embedder.proj.weight"].shape == (hidden, c, p, p)
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in sd.values())
    # pos_embed is the fixed 2-D sin-cos table of the DiT paper (MAE's get_2d_sincos_pos_embed):
    # first half of the channels encodes the column (w) index, second half the row (h) index, each
    # as [sin(pos*omega), cos(pos*omega)].
    grid = config["input_size"] // p
    omega = 1.0 / 10000 ** (np.arange(hidden // 4) / (hidden / 4))
    h, w = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    def enc(pos):
        out = pos.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    want = np.concatenate([enc(w), enc(h)], axis=1)[None]
    np.testing.assert_allclose(sd["pos_embed"], want, atol=1e-6)
    # Every other weight was drawn from N(0, 0.05^2): a wrong dtype, offset or byte order would not
    # look like that.
    others = np.concatenate([v.ravel() for k, v in sd.items() if k != "pos_embed"])
    assert others.size > 10000 and abs(others.std() - 0.05) < 0.002 and abs(others.mean()) < 0.002

def test_torch_legacy_inception_keys():
    """torch.save's legacy format, as pytorch-fid's weights file has it: the file holds the real
    file's 566 keys and storage types, every dimension cut to at most 2, with the random weights
    that random_inception.py draws for those shapes from the reference's seed."""
    sd = fid.load_torch(fixture("inception_random_legacy.pth"))
    keys = json.load(open(fixture("pt_inception_keys.json")))
    assert list(sd) == list(keys) and len(keys) == 566
    small = {k: dict(v, shape=[min(d, 2) for d in v["shape"]]) for k, v in keys.items()}
    seed = int(np.load(fixture("inception_reference_seeded.npz"))["weights_seed"])
    dtypes = {"FloatStorage": np.float32, "LongStorage": np.int64}
    for name, want in random_inception_weights(small, seed).items():
        assert sd[name].dtype == dtypes[keys[name]["dtype"]], name
        np.testing.assert_array_equal(sd[name], want, err_msg=name, strict=True)

def write_legacy_state_dict(path, state):
    """`state` ({name: array}) as torch.save(..., _use_new_zipfile_serialization=False) writes a
    state dict: one storage per tensor, contiguous."""
    storage_names = {np.dtype(np.float32): "FloatStorage", np.dtype(np.int64): "LongStorage"}
    entries, storages, itemsizes = [], {}, {}
    for i, (name, value) in enumerate(state.items()):
        strides = tuple(s // value.itemsize for s in value.strides)
        entries.append((name, _tensor(storage_names[value.dtype], str(i), value.size, 0,
                                      value.shape, strides)))
        storages[str(i)], itemsizes[str(i)] = value.tobytes(), value.itemsize
    _write_legacy(path, _Call(_Global("collections", "OrderedDict"), entries), storages, itemsizes)

def test_torch_refuses_malicious_pickle(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(RunsCommand(marker), protocol=2)
    with pytest.raises(dit.UnsafePickleError, match="system"):
        dit.safe_unpickle(io.BytesIO(payload), {})
    # The same call hidden in a state dict, in both torch file formats.
    evil = {"weight": _Call(_Global("os", "system"), f"touch {marker}")}
    _write_zip(str(tmp_path / "evil.pt"), evil, {})
    _write_legacy(str(tmp_path / "evil.pth"), evil, {}, {})
    for name in ("evil.pt", "evil.pth"):
        with pytest.raises(dit.UnsafePickleError, match="os.system.*malicious"):
            fid.load_torch(str(tmp_path / name))
    # Allowing a harmless global does not open the door to others.
    allowed = {("collections", "OrderedDict"): dict}
    assert dit.safe_unpickle(io.BytesIO(_pickle(_Call(_Global("collections", "OrderedDict")))),
                             allowed) == {}
    with pytest.raises(dit.UnsafePickleError):
        dit.safe_unpickle(io.BytesIO(_pickle(_Call(_Global("builtins", "eval"), "1"))), allowed)
    assert not marker.exists()

def test_torch_damaged_files_give_clear_errors(tmp_path):
    obj, storages, itemsizes, _ = _handbuilt_checkpoint()
    _write_zip(str(tmp_path / "good.pt"), obj, storages)
    _write_legacy(str(tmp_path / "good.pth"), obj, storages, itemsizes)
    cases = {"empty.pt": (b"", "empty"),
             "text.pt": (b"hello, not a checkpoint\n" * 10, "not a PyTorch file"),
             "garbage.pt": (np.random.default_rng(0).bytes(1000), None)}
    for name in ("good.pt", "good.pth"):
        raw = (tmp_path / name).read_bytes()
        cases["half_" + name] = (raw[: len(raw) // 2], None)
        cases["short_" + name] = (raw[:-5], None)
    # An archive that is not a torch file (e.g. an .npz) and one whose tensor data is shorter than
    # declared.
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
    # elements 2, 3, 4 of a 4-element storage
    obj = {"w": _tensor("FloatStorage", "0", 4, 2, (3,), (1,))}
    _write_zip(str(tmp_path / "oob.pt"), obj, {"0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(ValueError, match="reaches element 4"):
        dit.load_torch(str(tmp_path / "oob.pt"))

def test_torch_reader_refuses_tampering_and_blowups(tmp_path):
    # BUILD on an allowed storage type would rewrite it for every later load in the process.
    evil = (b"\x80\x02ctorch\nFloatStorage\n}X\x04\x00\x00\x00nameX\x0f\x00\x00\x00"
            b"BFloat16Storagesb.")
    with zipfile.ZipFile(tmp_path / "build.pt", "w") as z:
        z.writestr("ckpt/data.pkl", evil)
    with pytest.raises(UnsafePickleError, match="modify"):
        dit.load_torch(str(tmp_path / "build.pt"))
    pos_embed = dit.load_torch(fixture("dit_reference.pt"))["pos_embed"]
    grid = int(np.sqrt(pos_embed.shape[1]))
    np.testing.assert_allclose(pos_embed[0], dit.sincos_pos_embed_2d(pos_embed.shape[-1], grid),
                               atol=1e-6)
    # A stride of 0 makes a few stored bytes stand for a huge tensor.
    _write_zip(str(tmp_path / "expand.pt"),
               {"w": _tensor("FloatStorage", "0", 1, 0, (10 ** 5, 10 ** 5), (0, 0))},
               {"0": np.zeros(1, np.float32).tobytes()})
    with pytest.raises(ValueError, match="more elements than its storage"):
        dit.load_torch(str(tmp_path / "expand.pt"))
    # torch never compresses storages; a compressed one could be a zip bomb.
    with zipfile.ZipFile(tmp_path / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("ckpt/data.pkl", _pickle({"w": _tensor("FloatStorage", "0", 4, 0, (4,), (1,))}),
                   compress_type=zipfile.ZIP_STORED)
        z.writestr("ckpt/data/0", np.zeros(4, np.float32).tobytes())
    with pytest.raises(ValueError, match="compressed"):
        dit.load_torch(str(tmp_path / "bomb.pt"))

#################################################################################
#                 InceptionV3, statistics, FID, IS, command line                #
#################################################################################

@pytest.fixture(scope="session")
def inception_weights(tmp_path_factory):
    """A weights file in the layout of pytorch-fid's, holding the random weights that the Inception
    references were made with: drawn from their seed by random_inception.py's rule, so that the
    95 MB need not be stored (test_torch_legacy_inception_keys checks the real file's legacy
    format)."""
    seed = int(np.load(fixture("inception_reference_seeded.npz"))["weights_seed"])
    keys = json.load(open(fixture("pt_inception_keys.json")))
    path = str(tmp_path_factory.mktemp("inception") / "inception_random.pth")
    write_legacy_state_dict(path, random_inception_weights(keys, seed))
    return path

@pytest.fixture(scope="module")
def inception(inception_weights, tmp_path_factory):
    """The FID InceptionV3 with random weights (the real weights are not needed for parity)."""
    with pytest.warns(UserWarning, match="not pytorch-fid's official"):
        return fid.load_inception(inception_weights,
                                  cache_dir=str(tmp_path_factory.mktemp("cache")))

def test_fid_resize_matches_torch_formula():
    # Hand-computed from torch's rule src = (i + 0.5) * in / out - 0.5, clamped at 0, linear
    # between neighbours.
    # Upsampling 3 -> 5: src = 0 (clamped from -0.2), 0.4, 1.0, 1.6, 2.2 (the last pixel repeats
    # past the edge).
    up = [[1, 0, 0], [0.6, 0.4, 0], [0, 1, 0], [0, 0.4, 0.6], [0, 0, 1]]
    np.testing.assert_allclose(fid.resize_matrix(3, 5), up, atol=1e-6)
    # Downsampling 5 -> 2: src = 0.75 and 3.25; no antialiasing, so pixel 2 does not contribute at
    # all.
    down = [[0.25, 0.75, 0, 0, 0], [0, 0, 0, 0.75, 0.25]]
    np.testing.assert_allclose(fid.resize_matrix(5, 2), down, atol=1e-6)
    np.testing.assert_array_equal(fid.resize_matrix(299, 299), np.eye(299))
    # The 2-D resize applies the rule along each axis:
    # out[i, j] = sum_hw R_rows[i, h] R_cols[j, w] x[h, w].
    x = np.random.default_rng(0).random((2, 3, 5, 4)).astype(np.float32)  # (B, H, W, C)
    out = np.asarray(fid.resize_bilinear(x, 5, 2))
    np.testing.assert_allclose(out, np.einsum("ih,jw,bhwc->bijc", np.array(up), np.array(down), x),
                               atol=1e-6)

@slow
def test_fid_features_match_pytorch_fid_set32(inception):
    ref = np.load(fixture("inception_reference_seeded.npz"))
    n = 7  # a subset keeps the test short on a CPU
    images, pool, logits = ref["set32"][:n], ref["set32_pool3"][:n], ref["set32_logits"][:n]
    # 3 steps, the last one padded
    features = fid.InceptionFeatures(inception, batch_size=3, progress=False,
                                     protocol="pytorch-fid")
    features.update(images)
    with pytest.warns(UserWarning, match="singular"):
        out = features.result()
    assert out["count"] == n and out["logits"].shape == logits.shape
    assert rel_err(out["logits"], logits) < 1e-4
    assert rel_err(out["mu"], pool.astype(np.float64).mean(axis=0)) < 1e-4
    assert rel_err(out["sigma"], np.cov(pool.astype(np.float64), rowvar=False)) < 1e-4

@slow
def test_fid_evaluate_matches_pytorch_fid_features(inception, inception_weights):
    ref = np.load(fixture("inception_reference_seeded.npz"))
    # two images in each of the Inception Score's 10 splits (with one each, the score is exactly 1)
    n = 20
    pool, logits = ref["set32_pool3"][:n].astype(np.float64), ref["set32_logits"][:n]
    # No reference statistics: a 2048-d FID of 10 images would spend half a minute in sqrtm of a
    # singular matrix.
    with pytest.warns(UserWarning, match="singular"):
        out = fid.evaluate(ref["set32"][:n], inception=inception, batch_size=3, progress=False,
                           protocol="pytorch-fid")
    assert out["count"] == n and out["fid"] is None and out["protocol"] == "pytorch-fid"
    assert (rel_err(out["mu"], pool.mean(axis=0)) < 1e-4
            and rel_err(out["sigma"], np.cov(pool, rowvar=False)) < 1e-4)
    # The score takes the logits without the last layer's bias (as the TF original): pytorch-fid's
    # minus fc.bias.
    expected_is = fid.inception_score(
        logits - fid.load_torch(inception_weights)["fc.bias"])[0]
    # The score sits close to 1 with random weights, so compare what lies above 1.
    assert (expected_is > 1.0001
            and abs(out["inception_score"] - expected_is) < 1e-3 * (expected_is - 1))

@slow
def test_fid_features_sharded_over_two_devices(tmp_path, inception_weights):
    # Two simulated CPU devices in a fresh process: 5 images at 2 per device make a full step of 4,
    # then a step holding 1 image and 3 of padding spread over both devices; the padding must be
    # dropped, the order kept.
    weights, reference = inception_weights, fixture("inception_reference_seeded.npz")
    script = f"""
import warnings, numpy as np, jax, fid
assert jax.local_device_count() == 2
warnings.simplefilter("ignore")
features = fid.InceptionFeatures(fid.load_inception({weights!r}, cache_dir={str(tmp_path)!r}),
                                 2, progress=False, protocol="pytorch-fid")
features.update(np.load({reference!r})["set32"][:5])
np.save({str(tmp_path / "logits.npy")!r}, features.result()["logits"])
"""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script], cwd=HERE, env=env, check=True, timeout=120)
    logits = np.load(tmp_path / "logits.npy")
    assert logits.shape == (5, 1008)
    assert rel_err(logits, np.load(reference)["set32_logits"][:5]) < 1e-4

@pytest.mark.parametrize("name", ["set256", "set384"])
@slow
def test_fid_inception_matches_pytorch_fid(inception, name):
    ref = np.load(fixture("inception_reference_seeded.npz"))
    images = ref[name][:6]  # a subset keeps the test short on a CPU
    pool, logits, _ = nnx.jit(lambda model, x: model(x))(inception, images)
    assert pool.shape == (len(images), 2048) and logits.shape == (len(images), 1008)
    assert rel_err(pool, ref[f"{name}_pool3"][:len(images)]) < 1e-4
    assert rel_err(logits, ref[f"{name}_logits"][:len(images)]) < 1e-4

@slow
def test_fid_inception_multiplies_in_float32_on_every_backend():
    """Every product of the InceptionV3 asks XLA for HIGHEST precision, so that FID does not depend
    on the device (TF32 on NVIDIA GPUs, one bfloat16 pass on TPUs otherwise)."""
    graphdef, state = dit.module_shapes(fid.InceptionV3)
    found = products(lambda s, x: nnx.merge(graphdef, s)(x), state,
                     jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.uint8))
    # every conv and the fc layer, and the resize's two products
    assert len(found) == len(convs_and_linears(nnx.merge(graphdef, state))) + 2
    assert all(p == (jax.lax.Precision.HIGHEST,) * 2 and t == jnp.float32
               for _, p, t in found), found

def test_fid_frechet_distance_matches_pytorch_fid():
    ref = np.load(fixture("inception_reference_seeded.npz"))
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
    np.savez(tmp_path / "openai.npz", arr_0=np.zeros((2, 4, 4, 3), np.uint8),
             mu=mu.astype(np.float32), sigma=sigma)
    np.testing.assert_allclose(fid.load_statistics(str(tmp_path / "openai.npz"))[0], mu, rtol=1e-6)
    np.savez(tmp_path / "images.npz", arr_0=np.zeros((2, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="not FID statistics.*fid.py stats"):
        fid.load_statistics(str(tmp_path / "images.npz"))

@slow
def test_fid_load_inception_rejects_wrong_weights(tmp_path):
    # No "not the official weights" warning before the error: a failed run ends in its one line.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(dit.InputError,
                           match="missing keys .*Conv2d_1a_3x3.*not pytorch-fid's FID "
                                 "Inception weights"):
            fid.load_inception(fixture("dit_reference.pt"), cache_dir=str(tmp_path))
    assert not [w for w in caught if "official" in str(w.message)]
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

def test_fid_sources_by_dataset_name_and_count(tmp_path):
    """A source may name a dataset that dit.py reads (digits become RGB, as the sampler writes
    them); --images keeps N of any source, evenly spaced."""
    digits = np.random.default_rng(0).integers(0, 256, (7, 5, 5), dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte", digits)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(7, dtype=np.uint8))
    images = fid.load_images("mnist", count=3, data_dir=str(tmp_path))
    np.testing.assert_array_equal(images, np.repeat(digits[[0, 3, 6], ..., None], 3, axis=-1))
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(5):
        Image.fromarray(np.full((4, 4, 3), 10 * i, np.uint8)).save(folder / f"{i}.png")
    kept = fid.load_images(str(folder), count=2)
    assert len(kept) == 2 and kept[:2][:, 0, 0, 0].tolist() == [0, 40]

@slow
def test_fid_command_line(tmp_path, monkeypatch, capsys, inception_weights):
    ref = np.load(fixture("inception_reference_seeded.npz"))
    monkeypatch.setenv("DIT_CACHE", str(tmp_path / "cache"))
    fid.save_statistics(str(tmp_path / "a.npz"), ref["mu1"], ref["sigma1"])
    fid.save_statistics(str(tmp_path / "b.npz"), ref["mu2"], ref["sigma2"])
    fid.main(["fid", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")])
    assert f"FID (pytorch-fid) {float(ref['fid']):.4f}" in capsys.readouterr().out
    # Statistics of a folder of PNGs (lossless) equal those of pytorch-fid's features of the same
    # images.
    folder = tmp_path / "images"
    folder.mkdir()
    n = 7
    for i, image in enumerate(ref["set32"][:n]):
        Image.fromarray(image).save(folder / f"{i}.png")
    with pytest.warns(UserWarning):
        fid.main(["stats", str(folder), str(tmp_path / "out.npz"), "--batch-size", "3",
                  "--weights", inception_weights, "--protocol", "pytorch-fid"])
    mu, sigma = fid.load_statistics(str(tmp_path / "out.npz"))
    pool = ref["set32_pool3"][:n].astype(np.float64)
    assert (rel_err(mu, pool.mean(axis=0)) < 1e-4
            and rel_err(sigma, np.cov(pool, rowvar=False)) < 1e-4)

def test_fid_adm_resize_matches_tensorflow():
    # TensorFlow 1's ResizeBilinear (the Inception graph's node) as matrices, from TF itself.
    ref = np.load(fixture("adm_reference.npz"))
    for size in (32, 256, 384):  # up 9x, up a little, down
        np.testing.assert_allclose(fid.resize_matrix(size, 299, half_pixel=False),
                                   ref[f"resize_{size}"], atol=1e-6)

@slow
def test_fid_adm_features_match_evaluator_graph(inception):
    # torch-fidelity's TF-1-faithful port of the evaluator's graph on the same weights: pool
    # features, mixed_6/conv's sFID features and the logits without bias of the Inception Score.
    # (The resize, the one step that depends on the image size, is tested at 32, 256 and 384.)
    name = "set32"
    ref = np.load(fixture("adm_reference.npz"))
    n = 4  # one batch, the shape test_fid_reference_batches compiles too
    features = fid.InceptionFeatures(inception, batch_size=n, progress=False, protocol="adm")
    features.update(np.load(fixture("inception_reference_seeded.npz"))[name][:n])
    with pytest.warns(UserWarning, match="singular"):
        out = features.result()
    spatial = ref[f"{name}_spatial"][:n].astype(np.float64)  # (n, 17 * 17 * 7)
    assert rel_err(out["pool"], ref[f"{name}_pool"][:n]) < 1e-4
    assert rel_err(out["score_logits"], ref[f"{name}_score_logits"][:n]) < 1e-4
    assert (rel_err(out["mu_s"], spatial.mean(axis=0)) < 1e-4
            and rel_err(out["sigma_s"], np.cov(spatial, rowvar=False)) < 1e-4)

@slow
def test_fid_adm_scores_match_evaluator(monkeypatch, inception_weights):
    """The evaluator's own Inception Score, FID/sFID statistics and Precision/Recall code on the
    reference features."""
    ref = np.load(fixture("adm_reference.npz"))
    pool = np.concatenate([ref["set32_pool"], ref["set256_pool"], ref["set384_pool"]])
    weight = fid.load_torch(inception_weights)["fc.weight"]  # (1008, 2048)
    for split_size in (5000, 32):  # one part; parts of 32 and the rest
        score = fid.inception_score(pool.astype(np.float64) @ weight.T, split_size=split_size)[0]
        expected = float(ref[f"is_{split_size}"])
        # random weights put the score near 1; the evaluator's softmax is float32
        assert expected > 1.01 and abs(score - expected) < 1e-4 * (expected - 1)
    for key, feature in (("fid", "pool"), ("sfid", "spatial")):
        features = np.concatenate([ref[f"{n}_{feature}"] for n in ("set32", "set256", "set384")])
        dims, stats = ref[f"{key}_dims"], []
        for rows in (ref["samples"], ref["refs_b"]):
            accumulator = fid.FeatureStats(len(dims))
            accumulator.update(features[rows][:, dims])
            stats += accumulator.mu_sigma()
        assert abs(fid.frechet_distance(*stats) - ref[key]) / ref[key] < 1e-6
    cases = {"a": (pool[ref["refs_a"]], pool[ref["samples"]]),
             "b": (pool[ref["refs_b"]], pool[ref["samples"]])}
    cases["c"] = tuple(x * np.float32(ref["pr_c_scale"]) for x in cases["b"])  # float32 fallback
    for case, (refs, samples) in cases.items():
        assert fid.precision_recall(refs, samples) == tuple(ref[f"pr_{case}"])
        for features, radii in ((refs, ref[f"pr_{case}_radii_ref"]),
                                (samples, ref[f"pr_{case}_radii_samples"])):
            # TensorFlow's CPU kernel sums the squared norms in another order, so a norm may differ
            # by a float16 step (by float32 rounding in the fallback), and a distance
            # (norm - 2 dot + norm) by a few such steps of the norms
            norm = (features.astype(np.float64) ** 2).sum(axis=1).max()
            atol = 1e-5 * norm if case == "c" else 4 * float(np.spacing(np.float16(norm)))
            np.testing.assert_allclose(fid.manifold_radii(features), radii, rtol=0, atol=atol)
    # Blocks smaller than the sets: the same figures without the whole distance matrix at once.
    monkeypatch.setattr(fid, "PR_BLOCK", 10)
    assert fid.precision_recall(*cases["b"]) == tuple(ref["pr_b"])

def test_sample_counts_are_named_as_the_figures_are():
    """FID-10K and FID-50K in thousands; fewer or uneven counts as they are: FID-32, not
    FID-0.032K."""
    assert [dit.count_label(n) for n in (10_000, 50_000, 1_000, 32, 1_500)] == [
        "10K", "50K", "1K", "32", "1500"]

@slow
def test_fid_reference_batches(tmp_path, monkeypatch, inception):
    """`fid.py ref` writes the evaluator's layout; OpenAI's layout (images in arr_0) loads too, and
    its images' pool features are computed for Precision and Recall."""
    adm = np.load(fixture("adm_reference.npz"))
    images = np.load(fixture("inception_reference_seeded.npz"))["set32"]
    n = 4
    features = fid.InceptionFeatures(inception, batch_size=n, progress=False, protocol="adm")
    features.update(images[:n])
    with pytest.warns(UserWarning, match="singular"):
        out = features.result()
    out["pool"] = out["pool"][fid.evenly_spaced(n, 3)]
    fid.save_reference(str(tmp_path / "ref.npz"), out)
    ref = fid.load_reference(str(tmp_path / "ref.npz"))
    assert ref["protocol"] == "adm" and ref["pool"].shape == (3, 2048)
    assert rel_err(ref["pool"], adm["set32_pool"][[0, 2, 3]]) < 1e-4  # evenly spaced 3 of 4
    assert rel_err(ref["mu_s"], adm["set32_spatial"][:n].astype(np.float64).mean(axis=0)) < 1e-4
    assert ref["sigma_s"].shape == (fid.SPATIAL_DIM, fid.SPATIAL_DIM)
    # OpenAI's layout: mu, sigma, mu_s, sigma_s and the images themselves; no protocol named.
    np.savez(tmp_path / "openai.npz", arr_0=images[:n], mu=ref["mu"].astype(np.float32),
             sigma=ref["sigma"], mu_s=ref["mu_s"].astype(np.float32), sigma_s=ref["sigma_s"])
    openai = fid.load_reference(str(tmp_path / "openai.npz"))
    assert openai["protocol"] == "adm" and "pool" not in openai and len(openai["images"]) == n
    # A 2048-d Frechet distance of a few images is a slow square root of a singular matrix, and is
    # tested above: here only which statistics meet.
    met = []
    monkeypatch.setattr(fid, "frechet_distance", lambda *stats: met.append(stats[0].shape) or 1.0)
    with pytest.warns(UserWarning, match="singular"):
        result = fid.evaluate(images[n:2 * n], openai, inception, batch_size=n, progress=False)
    assert met == [(2048,), (fid.SPATIAL_DIM,)]
    assert rel_err(openai["pool"], adm["set32_pool"][:n]) < 1e-4
    assert result["protocol"] == "adm" and result["count"] == n
    assert result["precision"] is not None and result["recall"] is not None
    assert fid.describe(result).startswith("FID-4 (adm) 1.000, sFID-4 (adm) 1.000, IS-4 (adm) ")
    # A pytorch-fid reference does not score adm features.
    fid.save_statistics(str(tmp_path / "pt.npz"), ref["mu"], ref["sigma"])
    with pytest.raises(dit.InputError, match="pytorch-fid protocol, not adm"):
        fid.evaluate(images[:2], str(tmp_path / "pt.npz"), inception, protocol="adm")

@slow
def test_judge_reads_real_photos_and_is_seeded(tmp_path):
    """fixtures/judge.py, trained for a few epochs on the committed CIFAR-10 JPEGs but 5 of each
    class, reads those 50 as their labels better than chance and than with the labels shuffled;
    real against real is nearer than real against noise; the weights read back from its cache give
    the same figures, and so does a second training from the same seed (of 2 epochs, each)."""
    import judge
    root = tmp_path / "cifar10-jpeg"
    for name, paths in real_jpegs(root / "train", per_class=20, classes=10).items():
        os.makedirs(root / "test" / name)
        for path in paths[:5]:
            shutil.move(path, root / "test" / name)
    _, _, held, labels = judge.real_images("cifar10", str(root), 0)
    noise = np.random.default_rng(0).integers(0, 256, held.shape, np.uint8)
    sets = [(held, labels), (held, np.random.default_rng(1).permutation(labels)), (noise, labels)]
    run = lambda cache, epochs=20: judge.judge(sets, "cifar10", str(root),  # noqa: E731
                                               epochs=epochs, cache=cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 50 samples give singular covariances of 256 features
        real, shuffled, noisy = first = run(str(tmp_path / "judge.npz"))
        assert run(str(tmp_path / "judge.npz")) == first
        assert run(None, epochs=2) == run(None, epochs=2)
    assert real["accuracy"] == real["classifier_accuracy"] > max(0.1, shuffled["accuracy"])
    assert real["frechet_real"] < noisy["frechet"]

#################################################################################
#                                                                               #
#                             prepare_imagenet100.py                            #
#                                                                               #
#################################################################################

def kaggle_tree(root, photos):
    """A small tree in the Kaggle layout from real photos, with the kinds of damage real downloads
    have."""
    wnids = sorted(f[:-5] for f in os.listdir(photos) if f.endswith(".JPEG"))
    gray = "n03764736"  # a grayscale photo, per the data README
    a, b, c, d = [w for w in wnids if w != gray][:4]
    src = root / "src"
    for folder in ("train.X1/" + a, "train.X1/" + b, "train.X2/" + c, "train.X2/" + d, "val.X/" + a,
                   "val.X/" + c):
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

@slow
def test_prepare_latents_kaggle_tree(tmp_path):
    src, wnids, names = kaggle_tree(tmp_path, data("imagenet100-photos"))
    vae_dir = fixture("vae_reference")
    out = tmp_path / "out"
    args = [str(src), str(out), "--vae", vae_dir, "--resolution", "32", "--chunk-size", "2",
            "--batch-size", "2", "--workers", "2", "--no-fid"]
    manifest = prepare_imagenet100.main(args)

    latents, labels = np.load(out / "latents.npy", mmap_mode="r"), np.load(out / "labels.npy")
    kept = [("train.X1", 0, "1.JPEG"), ("train.X1", 0, "2.JPEG"), ("train.X1", 1, "cmyk.JPEG"),
            ("train.X2", 2, "gray.JPEG"), ("train.X2", 2, "png.JPEG")]
    vae = load_vae(vae_dir)
    assert (latents.dtype == np.float16
            and latents.shape == (5, 2, 16, 16, 2 * vae.cfg.latent_channels))
    assert labels.dtype == np.int64 and labels.tolist() == [k[1] for k in kept]
    crops = np.stack([center_crop_arr(Image.open(src / split / wnids[label] / f), 32)
                      for split, label, f in kept])
    x = crops.astype(np.float32) / 127.5 - 1
    mean, logvar = nnx.jit(lambda vae, x: vae.encode(x))(vae, np.concatenate([x, x[:, :, ::-1]]))
    for flip in (0, 1):
        rows = slice(5 * flip, 5 * flip + 5)
        assert rel_err(latents[:, flip, ..., :4], mean[rows]) < 1e-3  # float16 storage
        assert rel_err(latents[:, flip, ..., 4:], np.exp(0.5 * np.asarray(logvar[rows]))) < 1e-3
    # the flip is really a different image
    assert not np.allclose(latents[:, 0], latents[:, 1], atol=1e-2)

    assert ([s["file"] for s in manifest["skipped"]]
            == [os.path.join("train.X2", wnids[2], "truncated.JPEG")])
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

def as_a_device_multiplies(fn, mantissa_bits, passes=1):
    """fn with every float32 dot_general and conv_general_dilated computed as an accelerator does
    on the CPU, which always multiplies in float32: the operands rounded to `mantissa_bits`
    (bfloat16: 7, TF32: 10) and the products summed in float32; passes=3 adds the products of each
    operand's rounding remainder with the other's rounded value (bfloat16_3x, a TPU's "high").
    Returns (fn's outputs, the number of products so computed)."""
    count = 0

    def multiply(eqn, a, b):
        nonlocal count
        count += 1
        hi = lambda v: jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=mantissa_bits)
        bind = lambda a, b: eqn.primitive.bind(a, b, **{**eqn.params, "precision": None})
        out = bind(hi(a), hi(b))
        if passes == 3:
            out = out + bind(hi(a), hi(b - hi(b))) + bind(hi(a - hi(a)), hi(b))
        return out

    def run(jaxpr, consts, *args):  # jax.core.eval_jaxpr, inlining the nested jitted calls
        env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
        read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if (eqn.primitive.name in ("dot_general", "conv_general_dilated")
                    and ins[0].dtype == jnp.float32):
                outs = [multiply(eqn, *ins)]
            elif eqn.primitive.name in ("pjit", "jit"):
                outs = run(eqn.params["jaxpr"].jaxpr, eqn.params["jaxpr"].consts, *ins)
            else:
                bind = eqn.primitive.get_bind_params(eqn.params)  # jax 0.7: (subfuns, params)
                subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
                outs = eqn.primitive.bind(*subfuns, *ins, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def wrapped(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = run(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), outs), count
    return wrapped

@slow
def test_prepare_precision_stores_the_float32_latents():
    """At each --precision every product of the VAE asks XLA for it, and the latents that a device
    computes at the default for TPUs ("high", three bfloat16 passes) are float32's to float16's
    rounding, where one bfloat16 pass (a TPU's "default") or TF32 (a GPU's "default" and "high")
    are not: emulated on the CPU, on real photos through the small VAE of the fixtures."""
    vae = load_vae(fixture("vae_reference"))
    photos = data("imagenet100-photos")
    images = np.stack([dit.load_image(os.path.join(photos, f), 32)[0]
                       for f in sorted(os.listdir(photos)) if f.endswith(".JPEG")])
    graphdef, state = nnx.split(vae)
    encode = lambda precision: lambda state, x: prepare_imagenet100.encode_with_flip(
        nnx.merge(graphdef, state), x, precision)
    for precision in ("default", "high", "highest"):
        found = products(encode(precision), state, images)
        assert found and all(p == (jax.lax.Precision(precision),) * 2 for _, p, _ in found)
    tpu = types.SimpleNamespace(platform="tpu")
    assert prepare_imagenet100.default_vae_precision(tpu) == "high"
    assert prepare_imagenet100.default_vae_precision(jax.devices()[0]) == "highest"

    exact = np.asarray(jax.jit(encode("highest"))(state, images), np.float32)  # (5, 2, 16, 16, 8)
    # One float16 step at each latent's magnitude, and at least at the median magnitude: a sum's
    # rounding error scales with its terms, not with its result, which can be near 0.
    magnitude = np.maximum(np.abs(exact), np.median(np.abs(exact)))
    step = np.spacing(magnitude.astype(np.float16)).astype(np.float32)

    def steps_off(mantissa_bits, passes):  # the largest difference from float32's, in steps
        latents, n = as_a_device_multiplies(encode("highest"), mantissa_bits, passes)(state, images)
        assert n == len(products(encode("highest"), state, images))  # every product emulated
        return np.max(np.abs(np.asarray(latents, np.float32) - exact) / step)

    # Measured: 1 step for "high" (3.5% of the latents; its error before storing: 0.31 of half a
    # step), 79 for one bfloat16 pass (91% of them off), 12 for TF32 (57%). An error below half a
    # step leaves the stored value equal to float32's or the next one.
    assert steps_off(7, passes=3) <= 1
    assert steps_off(7, passes=1) > 8 and steps_off(10, passes=1) > 2

@slow
def test_train_on_prepared_imagenet100(tmp_path, monkeypatch):
    """What prepare_imagenet100.py writes is what `dit.py --dataset imagenet100` trains on, and the
    sample grids decode the latents with the same VAE."""
    src, _, _ = kaggle_tree(tmp_path, data("imagenet100-photos"))
    vae_dir, out, run = fixture("vae_reference"), tmp_path / "out", tmp_path / "run"
    prepare_imagenet100.main([str(src), str(out), "--vae", vae_dir, "--resolution", "32",
                              "--no-fid"])
    monkeypatch.setitem(dit.DIT_SIZES, "XS", dict(hidden_size=32, depth=1, num_heads=2))
    dit.main(["--dataset", "imagenet100", "--data-dir", str(out), "--vae", vae_dir, "--size", "XS",
              "--patch", "4", "--batch-size", "4", "--steps", "2", "--log-every", "1",
              "--sample-every", "2", "--sample-steps", "2", "--final-fid", "0", "--run-dir",
              str(run)])
    meta, _ = dit.read_checkpoint(dit.list_checkpoints(run)[-1])
    assert (meta["model"]["in_channels"] == 4 and meta["model"]["num_classes"] == 4
            and meta["latent_scale"] == 0.18215)
    grid = np.asarray(Image.open(run / "samples" / "step_0000002.png"))
    assert grid.shape == (4 * 34 + 2, 4 * 34 + 2, 3)  # 16 decoded 32x32 RGB images in a 4x4 grid

@slow
def test_prepare_moves_each_batch_once_and_reads_it_back_after_the_next(tmp_path, monkeypatch,
                                                                       inception_weights):
    """One transfer to the devices per batch, which both Inception programs read; a batch's results
    are read back once the next batch is dispatched (JAX dispatches asynchronously: the devices
    work on the next meanwhile), and a chunk's all before it is recorded as done."""
    monkeypatch.setenv("DIT_CACHE", str(tmp_path / "cache"))
    src, _, _ = kaggle_tree(tmp_path, data("imagenet100-photos"))  # 6 files
    events, batches = [], []  # batches: the arrays that device_put returned for them

    class Result:  # a program's output, which notes when it is read back
        def __init__(self, array, batch):
            self.array, self.batch = array, batch

        def __array__(self, dtype=None, copy=None):
            events.append(("read", self.batch))
            return np.asarray(self.array)

    def device_put(x, sharding):
        if isinstance(x, np.ndarray) and x.dtype == np.uint8:  # not the weights
            events.append(("put", len(batches)))
            batches.append(real_put(x, sharding))
            return batches[-1]
        return real_put(x, sharding)

    def sharded_apply(*args):
        run = real_apply(*args)

        def dispatch(x):
            batch = next(i for i, b in enumerate(batches) if b is x)
            events.append(("run", batch))
            return Result(run(x), batch)
        return dispatch

    def write_json(path, obj):
        if path.endswith("manifest.json"):
            events.append(("done", len(obj["chunks_done"])))
        real_write(path, obj)

    real_put, real_apply, real_write = (jax.device_put, prepare_imagenet100.sharded_apply,
                                        prepare_imagenet100.write_json)
    monkeypatch.setattr(jax, "device_put", device_put)
    monkeypatch.setattr(prepare_imagenet100, "sharded_apply", sharded_apply)
    monkeypatch.setattr(prepare_imagenet100, "write_json", write_json)
    with pytest.warns(UserWarning):  # the random Inception is not the official file
        prepare_imagenet100.main([str(src), str(tmp_path / "out"), "--pixels", "16",
                                  "--batch-size", "2", "--chunk-size", "4", "--workers", "1",
                                  "--inception", inception_weights])
    # chunks of 4 and 2 files; in batches of 2: 0, 1, then 2
    assert events == [("put", 0), ("run", 0), ("run", 0), ("put", 1), ("run", 1), ("run", 1),
                      ("read", 0), ("read", 0), ("read", 1), ("read", 1), ("done", 1),
                      ("put", 2), ("run", 2), ("run", 2), ("read", 2), ("read", 2), ("done", 2),
                      ("done", 2)]  # the last: the complete manifest

@slow
def test_prepare_on_two_hosts_with_local_disks(tmp_path):
    """A pod slice of 2 hosts x 2 devices, each host with its own disk, in processes that
    jax.distributed joined: the same command on both leaves the whole split on each."""
    src, _, _ = kaggle_tree(tmp_path, data("imagenet100-photos"))
    coordinator = f"localhost:{free_port()}"
    env = process_env(2)
    disks = [tmp_path / f"disk{k}" / "in100" for k in (0, 1)]

    def host(k):  # joins the other process, then runs the command line
        argv = [str(src), str(disks[k]), "--vae", fixture("vae_reference"), "--resolution", "32",
                "--chunk-size", "4", "--no-fid"]
        code = SHARED_PROGRAMS + (
            f"import jax, sys; jax.distributed.initialize({coordinator!r}, 2, {k}); "
            f"sys.path.insert(0, {HERE!r}); import dit, prepare_imagenet100; "
            f"dit.run_cli(prepare_imagenet100.main, {argv!r})")
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    procs = [host(0), host(1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    manifests = [json.load(open(d / "manifest.json")) for d in disks]
    assert all(m["complete"] and m["counts"]["images"] == 5 and m["timing"]["hosts"] == 2
               and m["timing"]["devices"] == 2 for m in manifests)
    for name in ("latents.npy", "labels.npy", "classes.json"):
        assert (disks[0] / name).read_bytes() == (disks[1] / name).read_bytes()

def test_prepare_resumes_without_redoing_chunks(tmp_path, monkeypatch):
    src, wnids, _ = kaggle_tree(tmp_path, data("imagenet100-photos"))
    args = lambda out: [str(src), str(out), "--pixels", "16", "--chunk-size", "2", "--batch-size",
                        "2", "--workers", "1", "--no-fid"]
    prepare_imagenet100.main(args(tmp_path / "whole"))

    real, calls = prepare_imagenet100.load_image, []

    # the 5th image read dies, as if the machine went down in chunk 2 (files 4-5)
    def failing(path, size):
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
    monkeypatch.setattr(prepare_imagenet100, "load_image",
                        lambda p, s: (calls.append(p), real(p, s))[1])
    manifest = prepare_imagenet100.main(args(tmp_path / "out"))
    assert len(calls) == 2  # only chunk 2 (the last two files) was read again
    assert sorted(manifest["chunks_done"]) == ["0", "1", "2"] and manifest["counts"]["images"] == 5
    for name in ("images.npy", "labels.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "out" / name),
                                      np.load(tmp_path / "whole" / name))
    images = np.load(tmp_path / "out" / "images.npy")
    assert images.dtype == np.uint8 and images.shape == (5, 16, 16, 3)
    np.testing.assert_array_equal(images[2],
                                  center_crop_arr(Image.open(src / "train.X1" / wnids[1]
                                                             / "cmyk.JPEG"), 16))
    calls.clear()
    # finished: nothing redone
    assert prepare_imagenet100.main(args(tmp_path / "out"))["complete"] and calls == []

@slow
def test_prepare_fid_statistics(tmp_path, monkeypatch, inception_weights):
    """fid_stats.npz holds the mean and covariance of the Inception pool features of the kept,
    cropped images."""
    # fid.py caches converted weights there
    monkeypatch.setenv("DIT_CACHE", str(tmp_path / "cache"))
    src, wnids, _ = kaggle_tree(tmp_path, data("imagenet100-photos"))
    weights = inception_weights
    # the random fixture is not the official file; 5 images give a singular covariance
    with pytest.warns(UserWarning):
        prepare_imagenet100.main([str(src), str(tmp_path / "out"), "--pixels", "16", "--chunk-size",
                                  "4", "--batch-size", "3", "--workers", "2", "--inception",
                                  weights])
    stats = np.load(tmp_path / "out" / "fid_stats.npz")
    images = np.load(tmp_path / "out" / "images.npy")
    with pytest.warns(UserWarning, match="not pytorch-fid's official"):
        inception = fid.load_inception(weights)
    pool3 = np.asarray(nnx.jit(lambda net, x: net(x, "pytorch-fid")[0])(inception, images),
                       np.float64)
    assert rel_err(stats["mu"], pool3.mean(0)) < 1e-5
    assert rel_err(stats["sigma"], np.cov(pool3, rowvar=False)) < 1e-4
    # Beside them, the adm protocol's reference batch of the same images.
    ref = fid.load_reference(str(tmp_path / "out" / "fid_ref.npz"))
    pool, _, spatial = (np.asarray(a, np.float64) for a in
                        nnx.jit(lambda net, x: net(x, "adm"))(inception, images))
    assert ref["protocol"] == "adm" and rel_err(ref["pool"], pool) < 1e-5
    assert rel_err(ref["mu"], pool.mean(0)) < 1e-5 and rel_err(ref["mu_s"], spatial.mean(0)) < 1e-5
    assert rel_err(ref["sigma_s"], np.cov(spatial, rowvar=False)) < 1e-4
    assert not (tmp_path / "out" / "inception.partial.npy").exists()
    assert not (tmp_path / "out" / "adm.partial.npy").exists()

#################################################################################
#                                                                               #
#           Every compiled program, lowered for TPUs and NVIDIA GPUs            #
#                                                                               #
#################################################################################
# No TPU and no NVIDIA GPU runs these tests, yet the project's users train on TPUs (a Kaggle v3-8's
# 8 cores) and GPUs. jax.export lowers a jitted function for platforms that this machine lacks, to
# the StableHLO that their compilers take, with each platform's own lowering rules and without
# compiling or running anything: an operation that has no TPU or CUDA lowering fails here, and so
# does a custom call that is not stable (jax.export's own check). The programs are built by the
# project's own functions, as its commands build them, at tiny sizes.

PLATFORMS = ("tpu", "cuda")

def lower(jitted, *args, platforms=PLATFORMS, disabled_checks=()):
    """jax.export's lowering of `jitted` for `platforms` at the shapes of args
    (jax.ShapeDtypeStruct or arrays)."""
    exported = jax.export.export(jitted, platforms=platforms,
                                 disabled_checks=disabled_checks)(*args)
    assert exported.platforms == platforms
    return exported

def spec(shape, dtype=jnp.float32, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

def tiny_config(objective, arch="dit", **overrides):
    return dit.DiTConfig(**{**dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32,
                                   depth=1, num_heads=2, num_classes=3,
                                   learn_sigma=dit.OBJECTIVES[objective].learn_sigma),
                            **dit.ARCHS[arch], **overrides})

@pytest.fixture
def xla_attention(monkeypatch):
    """The attention that TPUs run (and float32 models and NVIDIA GPUs before Ampere), whatever the
    machine running the tests: on an Ampere GPU attention_implementation would take cuDNN's, which
    no TPU lowers. test_cudnn_attention_lowers_for_cuda lowers cuDNN's for CUDA."""
    choose = dit.attention_implementation
    tpu = types.SimpleNamespace(platform="tpu")
    monkeypatch.setattr(dit, "attention_implementation",
                        lambda dtype, head_dim, device=None: choose(dtype, head_dim, tpu))

def traced_init_state(cfg, tx, mesh, fsdp, dtype, remat):
    """dit.init_state as train() calls it, traced and not run: (graphdef, the state's shapes, its
    shardings, the program that creates it, jitted)."""
    made = {}

    def init():
        made["graphdef"], state, made["shardings"] = dit.init_state(cfg, tx, 0, mesh, fsdp, dtype,
                                                                    remat)
        return state
    init = jax.jit(init)
    state = jax.eval_shape(init)
    return made["graphdef"], state, made["shardings"], init

def lower_training(cfg, objective, precision, remat, batch=4, fsdp=False, lower_init=False,
                   masking=None, terms=(), **lowering):
    """The programs of train(), over make_mesh's devices: the training step (jit_train_step, with
    deferred `masking` and auxiliary `terms` when given), the validation loss (jitted as the Evaluator jits it) and, with
    lower_init, the creation of the state; `lowering`: lower's options. Returns (the state's
    shapes, the training step's Exported)."""
    mesh, (tx, _) = dit.make_mesh(), dit.make_optimizer(1e-4, warmup=10, grad_clip=1.0)
    graphdef, state, shardings, init = traced_init_state(cfg, tx, mesh, fsdp,
                                                         dit.compute_dtype(precision), remat)
    objective = dit.make_objective(objective)
    if lower_init:
        lower(init, **lowering)
    split = NamedSharding(mesh, P("data"))
    x = spec((batch, cfg.input_size, cfg.input_size, cfg.in_channels), sharding=split)
    y = spec((batch,), jnp.int32, sharding=split)
    step_fn = dit.jit_train_step(graphdef, objective, tx, 0.999, False, 0, mesh, shardings,
                                 masking, terms)
    step = lower(step_fn, state, x, y, **lowering)
    lower(jax.jit(lambda params, x, y: dit.validation_losses(
        nnx.merge(graphdef, params), objective, x, y, jax.random.key(0)).mean(axis=1)),
        state["ema"], x, y, **lowering)
    return state, step

# Each architecture at each precision; each architecture meets every remat policy and both
# objectives.
REMATS = (None, *dit.REMAT_POLICIES)
TRAINING_CASES = [(arch, ("rf", "ddpm")[(i + j) % 2], precision, REMATS[(i + j) % len(REMATS)])
                  for i, arch in enumerate(dit.ARCHS)
                  for j, precision in enumerate(("fp32", "bf16", "fp16"))]

@pytest.mark.usefixtures("xla_attention")
@pytest.mark.parametrize("arch, objective, precision, remat", TRAINING_CASES)
@slow
def test_training_lowers_for_tpu_and_cuda(arch, objective, precision, remat):
    state, step = lower_training(tiny_config(objective, arch), objective, precision, remat)
    # float16 trains with loss scaling, in the state and in the step's metrics
    metrics = step.out_tree.unflatten(step.out_avals)[1]
    assert ("loss_scale" in state) == ("loss_scale" in metrics) == (precision == "fp16")

@pytest.mark.usefixtures("xla_attention")
@pytest.mark.parametrize("arch, objective, precision, remat", [("dit", "ddpm", "fp16", None),
                                                               ("dit+", "rf", "bf16", "dots")])
@slow
def test_masked_training_lowers_for_tpu_and_cuda(arch, objective, precision, remat):
    """Deferred masking's step: a mixer block on every patch, the gathers of the kept tokens, the
    backbone on them (DiT+'s RoPE at their positions), the scatter of their patches; with every
    auxiliary term on the kept tokens: SRA's teacher on the whole grid, gathered, the internal
    head's prediction scattered, the dispersive loss over the whole batch."""
    _, step = lower_training(
        tiny_config(objective, arch, depth=3, internal_block=2, sra_head=True), objective,
        precision, remat, masking=dit.DeferredMasking(0.75, 1),
        terms=(dit.Dispersive(3), dit.SRA(2, 3), dit.Internal()))
    assert set(step.out_tree.unflatten(step.out_avals)[1]["aux"]) == {"dispersive", "sra",
                                                                      "internal"}

# Each objective's samplers, unguided and guided (on the channels and in the interval that the
# sample command can ask for), on DiT+ with every switch on: unguided in float32, guided in bfloat16
# (rectified flow) and float16 (DDPM). The trajectory is the sample command's --gif.
SAMPLING_CASES = [(objective, method, cfg_scale,
                   "fp32" if cfg_scale == 1 else {"rf": "bf16", "ddpm": "fp16",
                                                  "edm": "bf16"}[objective])
                  for objective in dit.OBJECTIVES
                  for method in dit.make_objective(objective).METHODS
                  for cfg_scale in (1.0, 1.5)]

@pytest.mark.usefixtures("xla_attention")
@pytest.mark.parametrize("objective, method, cfg_scale, precision", SAMPLING_CASES)
@pytest.mark.parametrize("autoguided", [False, True], ids=["", "autoguided"])
def test_sampling_lowers_for_tpu_and_cuda(objective, method, cfg_scale, precision, autoguided):
    """Every sampler, with and without classifier-free guidance, alone and with autoguidance by a
    smaller network (as XS guides S) in the same program."""
    every_switch = {name: True for name in dit.ARCHS["dit"]}
    dtype = dit.compute_dtype(precision)
    graphdef, params = dit.module_shapes(dit.DiTPlus, tiny_config(objective, **every_switch),
                                        dtype=dtype)
    guide = dit.DiTPlus(tiny_config(objective, **every_switch, hidden_size=16), dtype=dtype,
                        rngs=nnx.Rngs(0)) if autoguided else None
    trajectory = method in ("heun", "ddim")
    sampler = dit.Sampler(graphdef, dit.make_objective(objective), dit.make_mesh(), steps=2,
                          method=method, cfg_scale=cfg_scale, guidance_channels=3,
                          interval=(100, 900), guide=guide, guide_scale=2.0,
                          return_trajectory=trajectory)
    noise, y = spec((4, 8, 8, 4)), spec((4,), jnp.int32)
    run = lower(sampler.run, params, sampler.guide_params, noise, y,
                jax.eval_shape(lambda: jax.random.key(0)), sampler.cfg_scale)
    # the guide's weights and the CFG scale are the program's inputs, not constants folded into it
    guide_inputs = len(jax.tree.leaves(sampler.guide_params))
    assert len(run.in_avals) == len(jax.tree.leaves(params)) + guide_inputs + 4
    assert (guide_inputs > 0) == autoguided
    assert run.out_avals[0].shape == (4, 8, 8, 4) and len(run.out_avals) == 1 + trajectory
    images = lower(sampler.finish, None, noise)
    assert images.out_avals[0].dtype == jnp.uint8

@slow
def test_autoencoder_lowers_for_tpu_and_cuda(monkeypatch):
    """prepare_imagenet100's encoder (encode_with_flip, jitted as sharded_apply jits it) and the
    samplers' chunked decoder (Sampler.finish with load_decoder's VAE): 7 latents in chunks of 3,
    two and a remainder. Float32, the VAE of CPUs and of float16 models; bfloat16's is lowered over
    8 devices below."""
    vae = dit.load_decoder(fixture("vae_reference"), 4, dit.vae_dtype("fp32"))
    graphdef, state = nnx.split(vae)
    encode = lower(jax.jit(lambda state, x: prepare_imagenet100.encode_with_flip(
        nnx.merge(graphdef, state), x)), state, spec((2, 16, 16, 3), jnp.uint8))
    assert encode.out_avals[0].shape == (2, 2, 8, 8, 8)
    monkeypatch.setattr(dit, "DECODE_CHUNK", 3)
    graphdef, _ = dit.module_shapes(dit.DiTPlus, tiny_config("rf"))
    sampler = dit.Sampler(graphdef, dit.make_objective("rf"), dit.make_mesh(), steps=2,
                          method="euler", cfg_scale=1.0, vae=vae,
                          latent_scale=vae.cfg.scaling_factor)
    decode = lower(sampler.finish, sampler.vae_params, spec((7, 8, 8, 4)))
    assert decode.out_avals[0].shape == (7, 16, 16, 3)

@pytest.mark.parametrize("protocol", fid.PROTOCOLS)
@slow
def test_inception_lowers_for_tpu_and_cuda(inception, protocol):
    """fid.py's Inception forward in each protocol, which FID and prepare_imagenet100's statistics
    run."""
    graphdef, state = nnx.split(inception)
    forward = lower(fid._inception_forward, graphdef, protocol, state,
                    spec((2, 32, 32, 3), jnp.uint8))
    assert [a.shape for a in forward.out_avals] == [(2, 2048), (2, 1008), (2, fid.SPATIAL_DIM)]

def test_cudnn_attention_lowers_for_cuda(monkeypatch):
    """On NVIDIA GPUs from Ampere on, 16-bit models attend with cuDNN's fused attention
    (attention_implementation), which the lowerings above, made as for a TPU, do not take: here the
    training step and a guided sampler take it, for CUDA. Its custom calls carry no compatibility
    guarantee, which jax.export checks for files meant to be kept; these lowerings are not kept."""
    ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
    choose = dit.attention_implementation
    monkeypatch.setattr(dit, "attention_implementation",
                        lambda dtype, head_dim, device=None: choose(dtype, head_dim, ampere))
    cfg = tiny_config("rf", "dit+", hidden_size=64)  # heads of 32, a multiple of 8
    assert dit.attention_implementation(jnp.bfloat16, cfg.hidden_size // cfg.num_heads) == "cudnn"
    fused = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    cuda = dict(platforms=("cuda",),
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in fused])
    try:
        _, step = lower_training(cfg, "rf", "bf16", "dots", **cuda)
    except RuntimeError as e:
        if "cuDNN is not detected" not in str(e):
            raise
        pytest.skip("cuDNN's fused attention cannot be lowered without the cuDNN library: "
                    "jax.nn.dot_product_attention(implementation='cudnn') asks the installed "
                    "cuDNN for its version while it traces; this test runs where CUDA does")
    assert all(target in step.mlir_module() for target in fused)
    graphdef, params = dit.module_shapes(dit.DiTPlus, cfg, dtype=jnp.bfloat16)
    sampler = dit.Sampler(graphdef, dit.make_objective("rf"), dit.make_mesh(), steps=2,
                          method="heun", cfg_scale=1.5)
    run = lower(sampler.run, params, None, spec((4, 8, 8, 4)), spec((4,), jnp.int32),
                jax.eval_shape(lambda: jax.random.key(0)), sampler.cfg_scale, **cuda)
    assert fused[0] in run.mlir_module()

def lower_on_a_v3_8(vae_dir):
    """What a TPU v3-8's 8 cores compile, at TPUs' default precision, bfloat16 (run with 8 devices
    by the next test): train()'s programs with the batch split over the devices, and with FSDP; a
    guided sampler and its chunked decoder (a shard_map over the devices) with the VAE in vae_dir;
    prepare_imagenet100's encoder. Returns what each lowering records of its devices and
    shardings."""
    assert jax.device_count() == 8
    mesh, found = dit.make_mesh(), {}
    for fsdp in (False, True):
        state, step = lower_training(tiny_config("rf", "dit+"), "rf", "bf16", "dots", batch=8,
                                     fsdp=fsdp, lower_init=True)
        shardings = step.in_shardings_jax(mesh)
        found["fsdp" if fsdp else "data"] = {
            "devices": step.nr_devices, "batch": list(shardings[-2].spec),
            "split_state": sum(any(s.spec) for s in shardings[:-2])}
    vae = dit.load_decoder(vae_dir, 4, dit.vae_dtype("bf16"))
    graphdef, params = dit.module_shapes(dit.DiTPlus, tiny_config("rf", "dit+"),
                                        dtype=jnp.bfloat16)
    sampler = dit.Sampler(graphdef, dit.make_objective("rf"), mesh, steps=2, method="heun",
                          cfg_scale=1.5, vae=vae, latent_scale=vae.cfg.scaling_factor)
    noise = spec((8, 8, 8, 4))
    found["sample"] = lower(sampler.run, params, None, noise, spec((8,), jnp.int32),
                            jax.eval_shape(lambda: jax.random.key(0)),
                            sampler.cfg_scale).nr_devices
    found["decode"] = lower(sampler.finish, sampler.vae_params, noise).nr_devices
    graphdef, state = nnx.split(vae)
    split = NamedSharding(mesh, P("data"))
    found["encode"] = lower(jax.jit(lambda state, x: prepare_imagenet100.encode_with_flip(
        nnx.merge(graphdef, state), x), out_shardings=split), state,
        spec((8, 16, 16, 3), jnp.uint8, split)).nr_devices
    return found

@slow
def test_programs_lower_for_the_8_cores_of_a_tpu_v3_8():
    script = (f"import json, sys; sys.path.insert(0, {HERE!r}); import test_dit; "
              f"print(json.dumps(test_dit.lower_on_a_v3_8({fixture('vae_reference')!r})))")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["data"] == {"devices": 8, "batch": ["data"], "split_state": 0}
    assert found["fsdp"]["devices"] == 8 and found["fsdp"]["split_state"] > 0
    assert found["sample"] == found["decode"] == found["encode"] == 8

#################################################################################
#                                                                               #
#                 Hostile and damaged files, every entry point                  #
#                                                                               #
#################################################################################
# Every failure a user's file can cause must end a command in one line, `error: ...`, that names
# the file, with a non-zero status and no traceback; no file may run code or make a reader
# allocate what the file does not hold. The files are built here by hand: pickles that reach
# os.system, builtins.eval or subprocess.call through several opcodes and protocols, size fields
# that lie, truncated archives, object arrays and wrong shapes. A payload that ran would create a
# marker file, which must never appear.

# A Python with jax imported holds about 250 MiB here. Every file below claims 1 GiB or more (or
# unpacks to that), so a reader that believed one and filled what it asked for would exceed this.
MEMORY_BOUND_KIB = 1 << 20

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

def gzip_bomb(head, mib):
    """gzip data that unpacks to `head` then `mib` MiB of zeros, in about a thousandth of that:
    one member of zeros, compressed once and repeated (a gzip file may hold many members)."""
    return gzip.compress(head) + gzip.compress(bytes(1 << 20)) * mib

def write_checkpoint(path, latent_scale=None, **model):
    """A training checkpoint of a small DiT, laid out as save_checkpoint writes one (the values are
    zeros), with `model` replacing fields of the configuration its metadata records. Returns the
    metadata and the arrays."""
    cfg = dit.DiTConfig(input_size=4, patch_size=2, in_channels=4, hidden_size=16, depth=1,
                        num_heads=2, num_classes=2, learn_sigma=False)
    tx, _ = dit.make_optimizer(1e-4)
    state = jax.eval_shape(lambda: dit.new_train_state(dit.DiT(cfg, rngs=nnx.Rngs(0)), tx))
    arrays = {name: np.zeros(like.shape, like.dtype) for name, like in dit.flatten(state).items()}
    meta = {"model": {**dataclasses.asdict(cfg), **model}, "objective": {"name": "rf"},
            "latent_scale": latent_scale}
    np.savez(path, __meta__=np.array(json.dumps(meta)), **arrays)
    return meta, arrays

def tar_member(name, size, kind=tarfile.REGTYPE):
    """The 512-byte header of a tar member `name` that claims `size` bytes (base-256 beyond 8 GiB,
    as GNU tar writes it)."""
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(tarfile.GNU_FORMAT)

@pytest.fixture(scope="module")
def hostile(tmp_path_factory, folder_data):
    """{name: path} of the hostile and damaged files, the good files the commands need beside
    them, and "marker", the file any payload would create."""
    d = tmp_path_factory.mktemp("hostile")
    marker = d / "MARKER"
    code = payloads(marker)
    paths = {"marker": str(marker), "dir": str(d), "image_folder": folder_data}

    def put(name, raw=None):
        paths[name] = str(d / name)
        os.makedirs(os.path.dirname(paths[name]), exist_ok=True)
        if raw is not None:
            (d / name).write_bytes(raw)
        return paths[name]

    # torch.save files: code in several opcodes, then sizes that lie
    _write_legacy(put("legacy_reduce.pth"), {"w": _Pickled(code["global_reduce"])}, {}, {})
    _write_zip(put("zip_eval.pt"), {"w": _Pickled(code["eval"])}, {})
    _write_legacy(put("legacy_obj.pt"), {"w": _Pickled(code["obj"])}, {}, {})
    put("protocol4_call.pt", code["stack_global"])
    put("inst.pt", code["inst"])
    put("empty.pt", b"")
    put("bytes8_8GiB.pt", b"\x80\x04\x8e" + struct.pack("<Q", 1 << 33) + b"tiny.")
    _write_zip(put("zip_numel_2_40.pt"),
               {"w": _tensor("FloatStorage", "0", 1 << 40, 0, (1 << 40,), (1,))}, {"0": bytes(16)})
    _write_legacy(put("legacy_numel_2_60.pth"),
                  {"w": _tensor("FloatStorage", "0", 1 << 60, 0, (4,), (1,))}, {"0": bytes(16)},
                  {"0": 4})

    # .npz files
    np.savez(put("object.npz"), arr_0=np.array([RunsCommand(marker)], object))
    write_zip_entries(put("header_2_40.npz"), [("arr_0.npy", npy_header((1 << 40,), np.uint8)
                                                  + bytes(16))])
    np.savez(put("stats.npz"), mu=np.zeros(8), sigma=np.eye(8))
    put("truncated.npz", (d / "stats.npz").read_bytes()[:700])
    np.savez(put("float_images.npz"), arr_0=np.zeros((4, 8, 8, 3), np.float32))
    np.savez(put("images.npz"), arr_0=np.zeros((10, 8, 8, 3), np.uint8))
    put("missing.npz")
    put("out.npz")

    # safetensors files: a header length of 2**60, a tensor terabytes past the end
    put("header_2_60.safetensors", struct.pack("<Q", 1 << 60) + b"{}")
    beyond = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40],
                               "data_offsets": [0, 1 << 42]}}).encode()
    put("beyond_end.safetensors", struct.pack("<Q", len(beyond)) + beyond + bytes(16))

    # DiT checkpoints: a latent model (for --vae), one whose weights are of another size
    write_checkpoint(put("small.npz"), latent_scale=0.18215)
    write_checkpoint(put("wrong_size.npz"), hidden_size=32)

    # Datasets: an IDX gzip bomb and an IDX header of 2**93 bytes, beside good labels
    idx = bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 2, 4, 4)
    put("mnist_bomb/train-images-idx3-ubyte.gz", gzip_bomb(idx + bytes(32), 2048))
    put("mnist_huge/train-images-idx3-ubyte", bytes([0, 0, 0x08, 3])
        + struct.pack(">3I", 1 << 31, 1 << 31, 1 << 31) + bytes(32))
    for folder in ("mnist_bomb", "mnist_huge"):
        write_idx(put(f"{folder}/train-labels-idx1-ubyte"), np.zeros(2, np.uint8))
    # CIFAR-10 archives: a batch whose BINBYTES8 claims 8 GiB, followed by 300 MiB of zeros in a
    # 300 KiB file; a batch that calls subprocess.call through STACK_GLOBAL
    batch = tar_member("cifar-10-batches-py/data_batch_1", 1 << 33)
    put("cifar_bomb/cifar-10-python.tar.gz",
        gzip_bomb(batch + b"\x80\x02\x8e" + struct.pack("<Q", 1 << 33), 300))
    write_cifar_archive(put("cifar_code/cifar-10-python.tar.gz"),
                        {"data_batch_1": code["stack_global"]})
    # Prepared ImageNet-100: labels.npy claiming 2**40 labels; a manifest.json that is a list
    for folder in ("in100_labels", "in100_manifest"):
        write_prepared(put(folder), pixels=8)
    put("in100_labels/labels.npy", npy_header((1 << 40,), np.int64) + bytes(16))
    put("in100_manifest/manifest.json", b"[1, 2]")
    # Run directories: a damaged run.json
    put("run_json/run.json", b'{"dataset": "folder", "si')

    # Trees for prepare_imagenet100.py: one class of one image, then the same with a damaged
    # Labels.json, and an output folder whose manifest.json is damaged.
    for tree in ("src", "src_labels"):
        os.makedirs(d / tree / "n01440764")
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(d / tree / "n01440764" / "a.png")
    put("src_labels/Labels.json", b'{"n01440764": "tench, Tinca tin')
    put("out_manifest/manifest.json", b'{"settings": {"split": "train"}, "chunks_')
    for name in ("out_vae", "out_inception", "out_labels", "out_manifest", "run", "x.safetensors"):
        put(name)
    paths.update({name: str(d / name) for name in os.listdir(d) if name not in paths})
    return paths

def folder_run(*extra):
    """`dit.py train` on the small image folder, into the run directory "run"."""
    return ["train", "--dataset", "folder", "--data-dir", "image_folder", "--resolution", "8",
            "--size", "XS", "--patch", "2", "--batch-size", "8", "--steps", "2", "--run-dir", "run",
            *extra]

# (command, arguments, the file the error must name, what the error must say). `says` tells the
# check that refused the file from an accident further on. Those in SUBPROCESS also run as a
# process of their own, a representative few for each command (a Python with jax takes seconds to
# start); all run in-process.
COMMAND_CASES = {
    "npz object array": ("fid.py", ["fid", "object.npz", "stats.npz"], "object.npz", "objects"),
    "npz header claims 2**40": ("fid.py", ["fid", "header_2_40.npz", "stats.npz"],
                                "header_2_40.npz", "claims shape"),
    "npz truncated": ("fid.py", ["fid", "truncated.npz", "stats.npz"], "truncated.npz",
                      "not a readable .npz"),
    "npz wrong shape": ("fid.py", ["is", "float_images.npz"], "float_images.npz", "uint8 RGB"),
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
    "legacy storage numel 2**60": ("fid.py", ["is", "images.npz", "--weights",
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
    "sample zip builtins.eval": ("dit.py", ["sample", "--ckpt", "zip_eval.pt"], "zip_eval.pt",
                                 "builtins.eval"),
    "sample legacy OBJ": ("dit.py", ["sample", "--ckpt", "legacy_obj.pt"], "legacy_obj.pt",
                          "only fid.py reads"),
    "sample safetensors header 2**60": ("dit.py", ["sample", "--ckpt", "header_2_60.safetensors"],
                                        "header_2_60.safetensors", f"claims {1 << 60} bytes"),
    "sample safetensors past the end": ("dit.py", ["sample", "--ckpt", "beyond_end.safetensors"],
                                        "beyond_end.safetensors", f"bytes 0..{1 << 42}"),
    "sample --vae legacy GLOBAL+REDUCE": ("dit.py", ["sample", "--ckpt", "small.npz", "--vae",
                                                     "legacy_reduce.pth"], "legacy_reduce.pth",
                                          "only fid.py reads"),
    "export npz object array": ("dit.py", ["export", "--ckpt", "object.npz", "--out",
                                           "x.safetensors"], "object.npz", "objects"),
    "export npz header claims 2**40": ("dit.py", ["export", "--ckpt", "header_2_40.npz", "--out",
                                                  "x.safetensors"], "header_2_40.npz",
                                       "claims shape"),
    "export npz truncated": ("dit.py", ["export", "--ckpt", "truncated.npz", "--out",
                                        "x.safetensors"], "truncated.npz", "not a readable"),
    "export weights of another size": ("dit.py", ["export", "--ckpt", "wrong_size.npz", "--out",
                                                  "x.safetensors"], "wrong_size.npz",
                                       "do not fit the model"),
    "train mnist gzip bomb": ("dit.py", ["train", "--dataset", "mnist", "--data-dir",
                                         "mnist_bomb"],
                              "mnist_bomb/train-images-idx3-ubyte.gz", "holds more"),
    "train mnist header of 2**93 bytes": ("dit.py", ["train", "--dataset", "mnist", "--data-dir",
                                                     "mnist_huge"],
                                          "mnist_huge/train-images-idx3-ubyte",
                                          "more than the file can hold"),
    "train cifar10 gzip bomb": ("dit.py", ["train", "--dataset", "cifar10", "--data-dir",
                                           "cifar_bomb"],
                                "cifar_bomb/cifar-10-python.tar.gz", "unpacks to more than"),
    "train cifar10 STACK_GLOBAL": ("dit.py", ["train", "--dataset", "cifar10", "--data-dir",
                                              "cifar_code"],
                                   "cifar_code/cifar-10-python.tar.gz", "subprocess.call"),
    "train imagenet100 labels claim 2**40": ("dit.py", ["train", "--dataset", "imagenet100",
                                                        "--data-dir", "in100_labels"],
                                             "in100_labels/labels.npy", "not a readable .npy"),
    "train imagenet100 manifest": ("dit.py", ["train", "--dataset", "imagenet100", "--data-dir",
                                              "in100_manifest"], "in100_manifest/manifest.json",
                                   "not the manifest"),
    "train damaged run.json": ("dit.py", folder_run("--run-dir", "run_json"), "run_json/run.json",
                               "not valid JSON"),
    "train --resume truncated checkpoint": ("dit.py", folder_run("--resume", "truncated.npz"),
                                            "truncated.npz", "delete it to resume"),
    "train --resume checkpoint of another size": ("dit.py", folder_run("--resume", "small.npz"),
                                                  "small.npz", "another model"),
}
SUBPROCESS = ["npz object array", "legacy GLOBAL+REDUCE", "prepare --vae builtins.eval",
              "prepare manifest.json", "sample safetensors header 2**60",
              "sample --vae legacy GLOBAL+REDUCE", "export npz object array",
              "train mnist gzip bomb", "train cifar10 gzip bomb",
              "train imagenet100 labels claim 2**40"]

def _command(hostile, case):
    """(script, arguments, the file named, says) of a case, the paths absolute as a user could type
    them, so that the message can be checked for them."""
    script, args, named, says = COMMAND_CASES[case]
    return script, [hostile.get(a, a) for a in args], hostile[named], says

def _one_clear_line(message, named, says):
    assert message.startswith("error: ") and "\n" not in message.strip(), message
    assert named in message and says in message, message

@pytest.mark.parametrize("case", SUBPROCESS)
@slow
def test_command_refuses_in_one_line(hostile, case):
    script, args, named, says = _command(hostile, case)
    env = dict(os.environ, JAX_PLATFORMS="cpu", DIT_CACHE=os.path.join(hostile["dir"], "cache"))
    proc, peak_kib = run_python([os.path.join(HERE, script), *args], env, cwd=hostile["dir"])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    _one_clear_line(lines[0], named, says)
    assert not os.path.exists(hostile["marker"])
    assert peak_kib < MEMORY_BOUND_KIB, f"peak memory {peak_kib >> 10} MiB"

@pytest.mark.parametrize("case", COMMAND_CASES)
@slow
def test_command_refuses_in_one_line_in_process(hostile, case, monkeypatch):
    """Each case through its command's main and dit.run_cli, what `python SCRIPT` runs. The CIFAR-10
    cap is lowered to 4 MiB here, so that the bomb stays within the bound tracemalloc checks (in
    its own process, under the real cap, the bomb is checked against MEMORY_BOUND_KIB)."""
    script, args, named, says = _command(hostile, case)
    main = {"fid.py": fid.main, "prepare_imagenet100.py": prepare_imagenet100.main,
            "dit.py": dit.main}[script]
    monkeypatch.setenv("DIT_CACHE", os.path.join(hostile["dir"], "cache"))
    monkeypatch.setattr(dit, "_CIFAR_MAX_BYTES", 4 << 20)
    monkeypatch.setitem(dit.DIT_SIZES, "XS", dict(hidden_size=32, depth=2, num_heads=2))
    monkeypatch.chdir(hostile["dir"])
    tracemalloc.start()
    try:
        with pytest.raises(SystemExit) as info:
            dit.run_cli(main, args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _one_clear_line(info.value.code, named, says)
    assert not os.path.exists(hostile["marker"])
    assert peak < 16 << 20, f"{peak >> 20} MiB allocated"

#################################################################################
#                 The same and more files, reader by reader                     #
#################################################################################

def _refused(read, path, says, error=dit.InputError):
    """Require `read(path)` to refuse the file, naming it and saying `says`, with at most 16 MiB
    allocated on the way (tracemalloc counts what numpy and pickle ask for, even memory never
    touched)."""
    tracemalloc.start()
    try:
        with pytest.raises(error, match=re.escape(str(path)) + ".*" + says):
            read(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{path}: {peak >> 20} MiB allocated"

def test_payloads_are_armed(tmp_path):
    """Plain pickle runs every payload here (which is why no reader may use it on a user's file):
    the marker staying away in the other tests means the readers refused them."""
    marker = tmp_path / "MARKER"
    for name, raw in payloads(marker).items():
        pickle.loads(raw)
        assert marker.exists(), name
        marker.unlink()
    np.savez(tmp_path / "object.npz", arr_0=np.array([RunsCommand(marker)], object))
    with np.load(tmp_path / "object.npz", allow_pickle=True) as f:
        f["arr_0"]
    assert marker.exists()

def test_hand_written_files_are_read_when_honest(tmp_path):
    """The writers above make files the readers accept, so a refusal below is of the lie alone."""
    values = np.arange(6, dtype=np.float32)
    state_dict = {"w": _tensor("FloatStorage", "0", 6, 0, (2, 3), (3, 1))}
    _write_zip(tmp_path / "good.pt", state_dict, {"0": values.tobytes()})
    _write_legacy(tmp_path / "good.pth", state_dict, {"0": values.tobytes()}, {"0": 4})
    for name in ("good.pt", "good.pth"):
        got = fid.load_torch(str(tmp_path / name))["w"]
        np.testing.assert_array_equal(got, values.reshape(2, 3))
    write_zip_entries(tmp_path / "good.npz", [("a.npy", npy_header((2, 3), np.float32)
                                               + values.tobytes())])
    got = dit.read_npz(str(tmp_path / "good.npz"))["a"]
    np.testing.assert_array_equal(got, values.reshape(2, 3))
    # Every entry of the overlapping zip reads with plain zipfile, together several times the file.
    write_overlapping_zip(tmp_path / "overlap.zip", [], ["a", "b", "c"], bytes(10000))
    with zipfile.ZipFile(tmp_path / "overlap.zip") as z:
        total = sum(len(z.read(name)) for name in ("a", "b", "c"))
    assert total > 2.5 * os.path.getsize(tmp_path / "overlap.zip")
    bomb = gzip_bomb(b"head", 3)
    assert len(bomb) < 20000 and gzip.decompress(bomb) == b"head" + bytes(3 << 20)
    (tmp_path / "a.tar").write_bytes(tar_member("a", 3) + b"abc" + bytes(509 + 1024))
    with tarfile.open(tmp_path / "a.tar") as tar:
        assert tar.extractfile("a").read() == b"abc"
    write_checkpoint(tmp_path / "small.npz", latent_scale=0.5)
    model, objective, meta = dit.load_model(str(tmp_path / "small.npz"))
    assert model.cfg.hidden_size == 16 and isinstance(objective, dit.RectifiedFlow)

def test_torch_reader_refuses_code_in_every_form(hostile, tmp_path):
    marker = tmp_path / "MARKER"
    names = {"global_reduce": "os.system", "eval": "builtins.eval",
             "stack_global": "subprocess.call", "inst": "os.system", "obj": "os.system"}
    for name, raw in payloads(marker).items():
        (tmp_path / f"{name}.pt").write_bytes(raw)  # where the legacy format's magic number goes
        _write_legacy(tmp_path / f"{name}_legacy.pth", {"w": _Pickled(raw)}, {}, {})
        _write_zip(tmp_path / f"{name}_zip.pt", {"w": _Pickled(raw)}, {})
        for path in (f"{name}.pt", f"{name}_legacy.pth", f"{name}_zip.pt"):
            _refused(fid.load_torch, tmp_path / path, re.escape(names[name]),
                     dit.UnsafePickleError)
    assert not marker.exists() and not os.path.exists(hostile["marker"])

def test_torch_reader_checks_every_claim_before_allocating(hostile, tmp_path):
    _refused(dit.load_torch, hostile["zip_numel_2_40.pt"], f"claims {1 << 40} elements")
    _refused(fid.load_torch, hostile["legacy_numel_2_60.pth"], f"claims {1 << 60} elements")
    _refused(dit.load_torch, hostile["bytes8_8GiB.pt"], f"expected {1 << 33} bytes")
    _refused(dit.load_torch, hostile["empty.pt"], "empty")
    # The count before a legacy storage's bytes disagrees with the pickle.
    _write_legacy(tmp_path / "count.pth", {"w": _tensor("FloatStorage", "0", 4, 0, (4,), (1,))},
                  {"0": bytes(16)}, {"0": 4})
    raw = (tmp_path / "count.pth").read_bytes()
    (tmp_path / "count.pth").write_bytes(raw[:-24] + struct.pack("<q", 1 << 60) + raw[-16:])
    _refused(fid.load_torch, tmp_path / "count.pth", f"holds {1 << 60} elements where 4")
    # One memo index makes the unpickler allocate and zero twice as many 8-byte slots: 256 MiB
    # here, enough to fail the bound without straining the machine should the check go (an index
    # of 2**30 takes 16 GiB).
    bomb = b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 24) + b"."
    (tmp_path / "memo.pt").write_bytes(bomb)
    _write_zip(tmp_path / "memo_zip.pt", _Pickled(bomb), {})
    _refused(dit.load_torch, tmp_path / "memo.pt", f"memo index {1 << 24}")
    _refused(dit.load_torch, tmp_path / "memo_zip.pt", f"memo index {1 << 24}")
    _write_zip(tmp_path / "bytes8_zip.pt",
               _Pickled(b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"x."), {})
    _refused(dit.load_torch, tmp_path / "bytes8_zip.pt", f"expected {1 << 40} bytes")
    # torch never compresses: a deflated data.pkl could expand a thousandfold.
    with zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("ckpt/data.pkl", _pickle({}))
    _refused(dit.load_torch, tmp_path / "deflated.pt", "data.pkl is compressed")
    # A data.pkl whose directory entry claims more bytes than the file holds.
    with zipfile.ZipFile(tmp_path / "long_pkl.pt", "w") as z:
        z.writestr("ckpt/data.pkl", _pickle({}))
        z.infolist()[0].file_size = 1 << 40
    _refused(dit.load_torch, tmp_path / "long_pkl.pt", f"claims {1 << 40} bytes")
    # Storages whose zip entries overlap: each holds the next, the file holds them once.
    kernel = np.ones(4000, np.float32).tobytes()
    outer = (30 + len("archive/data/1") + len(kernel)) // 4  # 0 holds 1's local header too
    pkl = _pickle({"a": _tensor("FloatStorage", "0", outer, 0, (outer,), (1,)),
                   "b": _tensor("FloatStorage", "1", 4000, 0, (4000,), (1,))})
    write_overlapping_zip(tmp_path / "overlap.pt", [("archive/data.pkl", pkl)],
                          ["archive/data/0", "archive/data/1"], kernel)
    _refused(dit.load_torch, tmp_path / "overlap.pt", "more than the file holds")
    # Many tensors viewing one storage: each costs the pickle a few bytes, and memory its size.
    _write_zip(tmp_path / "views.pt",
               {f"v{i}": _tensor("FloatStorage", "0", 4000, 0, (4000,), (1,)) for i in range(200)},
               {"0": kernel})
    _refused(dit.load_torch, tmp_path / "views.pt", "8 times the file's size")

def test_npz_reader_checks_every_claim_before_allocating(hostile, tmp_path):
    _refused(dit.read_npz, hostile["object.npz"], "objects")
    _refused(dit.read_npz, hostile["header_2_40.npz"], r"claims shape \(1099511627776,\)")
    _refused(dit.read_npz, hostile["truncated.npz"], "not a readable .npz")
    write_zip_entries(tmp_path / "negative.npz", [("a.npy", npy_header((-2, -3), np.uint8)
                                                   + bytes(6))])
    _refused(dit.read_npz, tmp_path / "negative.npz", r"claims shape \(-2, -3\)")
    write_zip_entries(tmp_path / "v3.npz", [("a.npy", b"\x93NUMPY\x03\x00" + bytes(8))])
    _refused(dit.read_npz, tmp_path / "v3.npz", r"format \(3, 0\)")
    (tmp_path / "pickle.npz").write_bytes(payloads(tmp_path / "MARKER")["global_reduce"])
    _refused(dit.read_npz, tmp_path / "pickle.npz", "not a readable .npz")
    # A deflated entry cannot expand more than 1032-fold.
    with zipfile.ZipFile(tmp_path / "deflate.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.npy", npy_header((8,), np.uint8) + bytes(8))
        z.infolist()[0].file_size = 1 << 40
    _refused(dit.read_npz, tmp_path / "deflate.npz", f"claims {1 << 40} bytes")
    # Entries that overlap: the innermost is a good array, the next holds it once more.
    kernel = npy_header((4000,), np.float64) + bytes(32000)
    write_overlapping_zip(tmp_path / "overlap.npz", [], ["b.npy", "a.npy"], kernel)
    _refused(dit.read_npz, tmp_path / "overlap.npz", "more than the file holds")
    assert not (tmp_path / "MARKER").exists()

def test_npz_reader_reads_what_numpy_writes(tmp_path):
    arrays = {"f": np.arange(12.0).reshape(3, 4), "fortran": np.asfortranarray(np.ones((3, 2))),
              "big_endian": np.arange(5, dtype=">i4"), "empty": np.zeros((0, 7), np.uint8),
              "scalar": np.array("text"), "record": np.zeros(2, [("x", "<f4"), ("y", "u1")])}
    for save in (np.savez, np.savez_compressed):
        save(tmp_path / "a.npz", **arrays)
        got = dit.read_npz(str(tmp_path / "a.npz"))
        assert set(got) == set(arrays)
        for name, want in arrays.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            np.testing.assert_array_equal(got[name], want)
        assert set(dit.read_npz(str(tmp_path / "a.npz"), ["f", "absent"])) == {"f"}

def test_safetensors_reader_checks_every_claim_before_allocating(hostile, tmp_path):
    read = dit.read_safetensors
    _refused(read, hostile["header_2_60.safetensors"], f"claims {1 << 60} bytes")
    _refused(read, hostile["beyond_end.safetensors"], f"bytes 0..{1 << 42}")

    def written(name, header, data=b""):
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return tmp_path / name

    # 4000 tensors over the same 256 KiB: a file of 500 KB whose copies would take 1 GiB.
    shared = {f"t{i}": {"dtype": "F32", "shape": [1 << 16], "data_offsets": [0, 1 << 18]}
              for i in range(4000)}
    _refused(read, written("shared.safetensors", shared, bytes(1 << 18)), "share bytes")

    def entry(shape, offsets):
        return {"w": {"dtype": "U8", "shape": shape, "data_offsets": offsets}}
    _refused(read, written("text.safetensors", entry([4], ["0", "4"]), bytes(4)), "spans bytes")
    _refused(read, written("negative.safetensors", entry([-1, 4], [0, 4]), bytes(4)),
             r"shape \[-1, 4\]")
    # numpy's int64 product of these is 0, which an empty span would match
    _refused(read, written("overflow.safetensors", entry([1 << 32, 1 << 32], [0, 0])),
             "not what shape")
    _refused(read, written("metadata.safetensors", {"__metadata__": {"model": 5}}),
             "__metadata__")
    _refused(read, written("nested.safetensors", b"[" * 100000), "not JSON")

def test_checkpoint_reader_and_load_model_check_every_claim(hostile, tmp_path):
    _refused(dit.read_checkpoint, hostile["object.npz"], "objects.*delete it to resume")
    _refused(dit.read_checkpoint, hostile["header_2_40.npz"], "claims shape")
    _refused(dit.read_checkpoint, hostile["truncated.npz"], "not a readable")
    _refused(dit.read_checkpoint, hostile["stats.npz"], "no metadata")
    kernel = npy_header((4000,), np.float64) + bytes(32000)
    write_overlapping_zip(tmp_path / "overlap.npz", [], ["b.npy", "a.npy"], kernel)
    _refused(dit.read_checkpoint, tmp_path / "overlap.npz", "more than the file holds")
    # Metadata that describes no model dit.py can build or sample, or weights that do not fit it
    meta, arrays = write_checkpoint(tmp_path / "good.npz")

    def rewritten(name, **changes):
        np.savez(tmp_path / name, __meta__=np.array(json.dumps({**meta, **changes})), **arrays)
        return tmp_path / name
    load, model = dit.load_model, meta["model"]
    _refused(load, hostile["wrong_size.npz"], "do not fit the model")
    _refused(load, rewritten("list.npz", model=[1, 2]), "no DiT configuration")
    _refused(load, rewritten("field.npz", model={**model, "heads": 2}), "no DiT configuration")
    _refused(load, rewritten("text.npz", model={**model, "depth": "1"}), "no DiT configuration")
    _refused(load, rewritten("deep.npz", model={**model, "depth": 10 ** 6}), "no DiT has")
    _refused(load, rewritten("odd.npz", model={**model, "hidden_size": 18}), "no DiT has")
    _refused(load, rewritten("scale.npz", objective={"name": "rf", "scale": -1}), "no objective")
    _refused(load, rewritten("ddpm.npz", objective={"name": "ddpm"}), "disagree")
    _refused(load, rewritten("latent.npz", latent_scale="big"), "latent_scale")
    with open(tmp_path / "meta.safetensors", "wb") as f:
        dit.write_safetensors(f, {}, {"model": "{", "objective": "{}", "latent_scale": "null"})
    _refused(load, tmp_path / "meta.safetensors", "no model configuration")
    # .pt files that are not official DiT checkpoints
    _write_zip(tmp_path / "numbers.pt", {"x_embedder.proj.weight": 5}, {})
    _refused(load, tmp_path / "numbers.pt", "not a DiT state dict")
    _write_zip(tmp_path / "foreign.pt", {"x_embedder.proj.weight": _tensor(
        "FloatStorage", "0", 4, 0, (1, 1, 2, 2), (4, 4, 2, 1))}, {"0": bytes(16)})
    _refused(load, tmp_path / "foreign.pt", "not those of an official DiT")

def test_idx_reader_reads_no_more_than_its_header_announces(hostile, tmp_path):
    _refused(read_idx, hostile["mnist_bomb/train-images-idx3-ubyte.gz"], "holds more")
    _refused(read_idx, hostile["mnist_huge/train-images-idx3-ubyte"],
             "more than the file can hold")
    # Gzipped, a header may claim what deflate can make of the file at most.
    head = bytes([0, 0, 0x08, 2]) + struct.pack(">I", 1 << 31)
    (tmp_path / "claims.gz").write_bytes(gzip.compress(head + struct.pack(">I", 1 << 31)))
    _refused(read_idx, tmp_path / "claims.gz", "more than the file can hold")
    (tmp_path / "short.gz").write_bytes(gzip.compress(head[:4] + struct.pack(">2I", 10, 100)
                                                      + bytes(10)))
    _refused(read_idx, tmp_path / "short.gz", "the file holds 10")

def test_cifar_reader_calls_nothing_and_reads_no_more_than_cifar_holds(hostile, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr(dit, "_CIFAR_MAX_BYTES", 4 << 20)  # the bomb's 300 MiB fail the bound

    def load(archive):
        return load_dataset("cifar10", os.path.dirname(archive))

    def archive(name, raw=None, batch=None):
        """An archive of `raw`, gzipped, or CIFAR-10's of one image a batch but its first."""
        os.makedirs(tmp_path / name)
        path = tmp_path / name / "cifar-10-python.tar.gz"
        if batch is None:
            path.write_bytes(gzip.compress(raw))
        else:
            write_cifar_archive(path, {**cifar_files(n=1)[0], "data_batch_1": batch})
        return path
    _refused(load, hostile["cifar_bomb/cifar-10-python.tar.gz"], f"more than {4 << 20} bytes")
    _refused(load, hostile["cifar_code/cifar-10-python.tar.gz"], "subprocess.call",
             dit.UnsafePickleError)
    # tarfile reads a pax header whole, whatever size it claims
    pax = tar_member("PaxHeaders/a", 1 << 40, tarfile.XHDTYPE)
    _refused(load, archive("pax", pax + bytes(1024)), f"more than {4 << 20} bytes")
    # numpy.ndarray and _reconstruct allocate what their arguments ask
    ndarray, rebuild = _Global("numpy", "ndarray"), _Global("numpy.core.multiarray", "_reconstruct")
    _refused(load, archive("ndarray", batch=_pickle(_Call(ndarray, (1 << 40,)))), "TypeError")
    _refused(load, archive("rebuild", batch=_pickle(_Call(rebuild, ndarray, (1 << 40,), "b"))),
             "never do")
    _refused(load, archive("labels", batch=py2_pickle({"data": np.zeros((1, 3072), np.uint8),
                                                       "labels": ["cat"]})), "classes in 0-9")

def test_imagenet100_files_are_checked(hostile, tmp_path):
    def load(path):
        return load_dataset("imagenet100", os.path.dirname(path))
    _refused(load, hostile["in100_labels/labels.npy"], "not a readable .npy")
    _refused(load, hostile["in100_manifest/manifest.json"], "not the manifest")
    cases = {"classes.json": (b'{"0": "tench"}', r"not a list of \{"),
             "labels.npy": (np.array([[0]] * 12), "does not hold 12 labels"),
             "images.npy": (np.array([RunsCommand(tmp_path / "MARKER")] * 12), "Python objects")}
    for name, (content, says) in cases.items():
        folder = tmp_path / name
        write_prepared(str(folder), pixels=8)
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            np.save(folder / name, content, allow_pickle=True)
        _refused(load, folder / name, says)
    assert not (tmp_path / "MARKER").exists()

def test_vae_config_is_checked_before_the_model_is_built(tmp_path):
    with open(tmp_path / "diffusion_pytorch_model.safetensors", "wb") as f:
        dit.write_safetensors(f, {"encoder.conv_in.bias": np.zeros(128, np.float32)}, {})
    for config, says in [("[1]", "not a diffusers config"),
                         ('{"block_out_channels": 5}', "not positive whole numbers"),
                         ('{"layers_per_block": 1000000}', "too few for the VAE"),
                         ('{"norm_num_groups": 3, "block_out_channels": [4]}', "norm_num_groups")]:
        (tmp_path / "config.json").write_text(config)
        _refused(load_vae, tmp_path, says)

def test_tensorboard_holds_each_step_once(tmp_path, monkeypatch, capsys):
    """The records and grids go to TensorBoard's event files as they go to metrics.jsonl; a run
    resumed at step 3 replaces what an earlier process logged after step 3. Without the
    tensorboard package, one line says so."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer
    # The two writers stand for two processes, whose files sort by the second each opened its own;
    # within one second they sort by a per-process counter compared as text ("10" before "9").
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))
    first = dit.TensorBoard(str(tmp_path), 0)
    for step in range(1, 6):
        first.scalars({"step": step, "loss": 1.0 / step, "loss_t": {"0.00-0.25": 2.0, "x": None}})
    first.writer.close()
    resumed = dit.TensorBoard(str(tmp_path), 3)
    for step in (4, 5):
        resumed.scalars({"step": step, "loss": 10.0 * step})
    resumed.image(5, Image.new("RGB", (6, 4), (255, 0, 0)))
    resumed.writer.close()
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert [e.step for e in board.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert [e.value for e in board.Scalars("loss")] == pytest.approx([1, 1 / 2, 1 / 3, 40, 50])
    assert [e.step for e in board.Scalars("loss_t/0.00-0.25")] == [1, 2, 3]
    (image,) = board.Images("samples")
    assert (image.step, image.width, image.height) == (5, 6, 4)
    assert Image.open(io.BytesIO(image.encoded_image_string)).getpixel((0, 0)) == (255, 0, 0)

    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    dit.TensorBoard(str(tmp_path / "without"), 0).scalars({"step": 1, "loss": 1.0})
    assert "tensorboard package is not installed" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "without")

def test_metrics_log_drops_lines_that_are_not_records(tmp_path):
    """A resumed run keeps the records up to its step; a damaged line goes, with no error."""
    (tmp_path / "metrics.jsonl").write_bytes(
        b'{"step": 1}\n[1, 2]\n{"step": "2"}\n\xff\xfe\n{"loss": 1}\n' + b"[" * 100000
        + b'\n{"step": 3}\n{"step": 2, "loss": 0.5}\n')
    dit.MetricsLog(str(tmp_path), 2, 8, None)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2, "loss": 0.5}\n'

def test_statistics_and_images_name_the_file(tmp_path):
    np.savez(tmp_path / "text.npz", mu=np.array(["a", "b"]), sigma=np.array([["a"] * 2] * 2))
    _refused(fid.load_statistics, tmp_path / "text.npz", "not a real")
    np.savez(tmp_path / "gray.npz", arr_0=np.zeros((2, 8, 8), np.uint8))
    _refused(fid.load_images, tmp_path / "gray.npz", "uint8 RGB")
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(20))
    with pytest.raises(dit.InputError, match=re.escape(str(folder / "broken.png"))):
        fid.load_images(str(folder))

def test_prepare_names_damaged_inputs_and_outputs(tmp_path, monkeypatch):
    src, out = tmp_path / "src", tmp_path / "out"
    for split in ("train.X1/n01440764", "val.X/n01440764"):
        os.makedirs(src / split)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(src / split / "a.png")
    args = [str(src), str(out), "--pixels", "8", "--no-fid"]

    def refused(path, says, extra=()):
        with pytest.raises(dit.InputError, match=re.escape(str(path)) + ".*" + says):
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
        dit.run_cli(fails(dit.InputError("a.npz is bad:\nthe library said\nso")))
    assert info.value.code == "error: a.npz is bad: the library said so"
    with pytest.raises(SystemExit) as info:
        dit.run_cli(fails(FileNotFoundError(2, "No such file or directory", "b.npz")))
    assert info.value.code == "error: b.npz: No such file or directory"
    with pytest.raises(KeyError):  # a bug: not caught, so Python prints its traceback
        dit.run_cli(fails(KeyError("x")))
    assert dit.run_cli(lambda argv: ("ran", argv), ["--flag"]) == ("ran", ["--flag"])

#################################################################################
#                        FID at the guidance a sweep chose                      #
#################################################################################

def true_fid(cfg_scale, interval, guide_scale, guided):
    """The FID that stub_sampling's images carry: lowest, 15, at autoguidance 3 alone; CFG, its
    interval and the combination all higher (CFG 1.5 with autoguidance 2: 21.5)."""
    return (40 + 3 * abs(cfg_scale - 1) + 3 * (interval is not None)
            - guided * (10 + 5 * guide_scale))

def stub_sampling(monkeypatch, fed):
    """Samples whose every pixel is the setting's true_fid / 100 (in [-1, 1]), and an Inception
    that reads it back as FID, the images fed to it kept in `fed`."""
    def sample(model, objective, noise, y, key, *, cfg_scale=1.0, interval=None, guide=None,
               guide_scale=1.0, **options):
        guided = guide is not None and guide_scale != 1
        return jnp.full(noise.shape, true_fid(cfg_scale, interval, guide_scale, guided) / 100)

    def evaluate(images, ref, inception):
        fed.append(images)
        return {"count": len(images), "protocol": ref["protocol"],
                "fid": float((images.mean() - 128) / 127.5 * 100), "sfid": None,
                "inception_score": 1.0, "inception_score_std": 0.0, "precision": None,
                "recall": None}
    monkeypatch.setattr(dit, "sample", sample)
    monkeypatch.setattr(fid, "load_inception", lambda *args, **kwargs: None)
    monkeypatch.setattr(fid, "evaluate", evaluate)

@slow
def test_final_fid_at_the_guidance_its_sweep_chose(tmp_path, folder_data, monkeypatch, capsys):
    """Without a --fid-* guidance option, the final FID-N is of the setting that scored best on
    N // 10 samples each (autoguidance 3 by the EMA kept at step 6, nearest half of 12, best by
    construction): the sweep's samples together at most N, each setting logged in metrics.jsonl,
    and `report` draws and tabulates them."""
    ref = tmp_path / "ref.npz"
    np.savez(ref, mu=np.zeros(4), sigma=np.eye(4))
    fed = []
    stub_sampling(monkeypatch, fed)
    monkeypatch.setitem(dit.DIT_SIZES, "XS", TINY_XS)
    run_dir = tmp_path / "run"
    dit.main(train_args(folder_data, run_dir, 12, ["--final-fid", "45", "--fid-ref", str(ref)]))
    assert sorted(os.listdir(run_dir / "ema")) == [f"step_{s:07d}.safetensors" for s in (3, 6, 12)]
    guide = str(run_dir / "ema" / "step_0000006.safetensors")
    sweep = [r for r in records(run_dir) if "cfg_scale" in r]
    assert len(sweep) == 10 and all(r["step"] == 12 and r["fid_samples"] == 4 for r in sweep)
    # every setting as sampled: the FID that its images carry (to uint8's rounding)
    for r in sweep:
        guided = r["guide"] is not None
        assert r["guide"] in (None, guide) and r["guide_step"] == (6 if guided else None)
        assert r["fid"] == pytest.approx(true_fid(r["cfg_scale"], r["guidance_interval"],
                                                  r["guide_scale"], guided), abs=1)
    assert {(r["cfg_scale"], r["guide_scale"]) for r in sweep} >= {(4, 1), (1, 3), (1.5, 2)}
    assert [r["guidance_interval"] for r in sweep if r["guidance_interval"]] == [[0, 750]] * 2
    # the cost: the sweep's samples together at most the final FID's, from other noise
    assert [len(images) for images in fed] == [4] * 10 + [45]
    [final] = [r for r in records(run_dir) if "fid" in r and "cfg_scale" not in r]
    assert final["fid_samples"] == 45 and final["fid"] == pytest.approx(15, abs=1)
    chosen = f"guidance 1, autoguidance 3 by {guide}, the best of 10 settings at 4 samples each"
    assert final["guidance"] == chosen
    assert re.search(rf"^step 12: FID-45 \(pytorch-fid\) [\d.]+, IS-45 \(pytorch-fid\) 1.00, "
                     rf"at {re.escape(chosen)}$", capsys.readouterr().out, re.M)
    report = dit.main(["report", str(run_dir), "--out", str(tmp_path / "out")])
    by_scale = panels(report.figure)["FID by guidance (newest sweep)"]
    unguided = xy(by_scale.lines[0])  # CFG over every noise level
    np.testing.assert_allclose(unguided, [[1, 1.5, 2, 3, 4], [
        next(r["fid"] for r in sweep if r["cfg_scale"] == s and not r["guidance_interval"]
             and r["guide"] is None) for s in (1, 1.5, 2, 3, 4)]])
    by_weight = panels(report.figure)["FID by autoguidance (newest sweep)"]
    np.testing.assert_allclose(xy(by_weight.lines[0])[0], [1, 2, 3])
    assert chosen in (tmp_path / "out" / "report.md").read_text()

@slow
def test_a_fid_option_fixes_the_guidance(tmp_path, folder_data, monkeypatch):
    """--fid-cfg-scale (or any other --fid-* guidance option) fixes the final FID's setting: no
    sweep, one evaluation of all N samples; a sweep of more settings than samples is refused."""
    ref = tmp_path / "ref.npz"
    np.savez(ref, mu=np.zeros(4), sigma=np.eye(4))
    fed = []
    stub_sampling(monkeypatch, fed)
    monkeypatch.setitem(dit.DIT_SIZES, "XS", TINY_XS)
    run_dir = tmp_path / "run"
    dit.main(train_args(folder_data, run_dir, 3, ["--final-fid", "12", "--fid-ref", str(ref),
                                                   "--fid-cfg-scale", "4"]))
    [final] = [r for r in records(run_dir) if "fid" in r]
    assert [len(images) for images in fed] == [12] and "guidance" not in final
    assert final["fid"] == pytest.approx(true_fid(4, None, 1, False), abs=1)
    with pytest.raises(dit.InputError, match="FID samples below the 10 settings"):
        dit.main(train_args(folder_data, tmp_path / "few", 3, ["--final-fid", "9", "--fid-ref",
                                                                str(ref)]))

def test_sweep_settings_follow_the_model_and_its_kept_guides(tmp_path):
    """The guide is the kept EMA before the step nearest half of it; CFG's settings need a null
    label, autoguidance's a guide."""
    assert dit.kept_guide(str(tmp_path), 100) is None
    (tmp_path / "ema").mkdir()
    for step in (10, 20, 40, 80, 160):
        (tmp_path / "ema" / f"step_{step:07d}.safetensors").touch()
    (tmp_path / "ema" / "notes.txt").touch()
    at = lambda step: os.path.basename(dit.kept_guide(str(tmp_path), step))  # noqa: E731
    assert [at(s) for s in (30, 100, 160, 400)] == [
        "step_0000010.safetensors", "step_0000040.safetensors", "step_0000080.safetensors",
        "step_0000160.safetensors"]
    assert dit.kept_guide(str(tmp_path), 10) is None
    cfg = dit.DiTConfig(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=1,
                        num_heads=2, num_classes=10)
    everything = dit.swept_settings(cfg, "g")
    assert len(everything) == len(dit.FID_SWEEP) == 10
    assert max(scale for scale, _, _, _ in everything) >= 4
    assert [s[:3] for s in dit.swept_settings(cfg, None)] == [
        (scale, interval, (None, 1.0)) for scale, interval, w in dit.FID_SWEEP if w == 1]
    no_null = dataclasses.replace(cfg, class_dropout_prob=0.0)
    assert [s[:3] for s in dit.swept_settings(no_null, "g")] == [
        (1.0, None, (None, 1.0)), (1.0, None, ("g", 2.0)), (1.0, None, ("g", 3.0))]

@slow
@pytest.mark.xdist_group("straight_run")
def test_sample_scores_the_runs_guidance_sweep(tmp_path, straight_run, monkeypatch):
    """`sample --fid N --guidance-sweep` samples and scores each setting of the sweep at N, guided
    by the run's kept EMA nearest half the weights' step (3 and 6 kept, step 9: the earlier), a
    file and a record each; other guidance options beside it are refused."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    ref = tmp_path / "ref.npz"
    np.savez(ref, mu=np.zeros(4), sigma=np.eye(4))
    fed = []
    stub_sampling(monkeypatch, fed)
    common = ["sample", "--ckpt", str(run_dir / "ema.safetensors"), "--fid", "5", "--batch-size",
              "4", "--steps", "2", "--ref", str(ref), "--out", str(tmp_path / "sweep" / "s.npz")]
    printed = dit.main(common + ["--guidance-sweep"])
    guide = str(run_dir / "ema" / "step_0000003.safetensors")
    assert len(printed) == 10 and [len(images) for images in fed] == [5] * 10
    assert printed[f"guidance 1, autoguidance 3 by {guide}"]["fid"] == pytest.approx(15, abs=1)
    assert len(os.listdir(tmp_path / "sweep")) == 10
    logged = [r for r in records(run_dir) if "cfg_scale" in r]
    assert [r["fid"] for r in logged] == [s["fid"] for s in printed.values()]
    assert {r["guide"] for r in logged} == {None, guide}
    for extra in (["--cfg-scale", "2"], ["--guide", guide, "--guide-scale", "2"]):
        with pytest.raises(dit.InputError, match="--guidance-sweep samples its own settings"):
            dit.main(common + ["--guidance-sweep", *extra])

# ------------------- bench --target: compiled for a device the machine lacks -------------------
# With XLA's TPU compiler (libtpu, jax[tpu]) and its CUDA compiler (jax[cuda12]), which .ci/run
# installs: these tests compile for a TPU v3-8 and NVIDIA GPUs on the CPU, and never skip.

def bench_target(capsys, target, *options):
    """The lines that `bench --target` prints."""
    dit.main(["bench", "--target", target, *options])
    return capsys.readouterr().out.splitlines()

TINY_RUN = ["--size", "XXS", "--patch", "4", "--image-size", "8"]

# XLA's TPU compiler takes longer the larger a program's batch and the nearer it comes to a core's
# memory: here 5 s to refuse the step and 37 s of CPU to accept its micro-batches (of 64x64 inputs,
# 128 a core), where 32x32 inputs at 2,048 a core take 50 s.
@slow
def test_target_tpu_refusal_is_one_line_with_what_fits(capsys, monkeypatch):
    """A batch whose training step XLA's TPU compiler refuses (more than a v3 core's HBM): one line,
    with the micro-batches that the compiler then accepts; the other programs follow, named rather
    than compiled: the course run's test compiles the sampler for a TPU, and
    fixtures/targets/v3-8.txt holds the VAE's and the Inception's lines (minutes of compiling)."""
    images = []
    monkeypatch.setattr(dit, "bench_target_images", lambda *args: images.append(args))
    monkeypatch.setattr(dit, "compiled_line", lambda name, compile, limit: f"  {name}")
    _, train, sample = bench_target(capsys, "v3-8", "--size", "XXS", "--patch", "2",
                                    "--image-size", "64", "--batch-size", "2048")
    assert len(images) == 1 and sample.startswith("  sample:  heun, 25 steps")
    assert re.fullmatch(r"  train:   the training step needs more than a device's 15.48 GiB "
                        r"\(XLA's compiler refused it at 256 samples a device at a time\); try "
                        r"--grad-accum \d+ \(about [\d.]+ GiB\), --remat, a smaller --batch-size",
                        train), train

def test_target_gpu_traces_its_attention_and_precision():
    """A GPU target's trace takes what that GPU runs: cuDNN's attention and bfloat16 from Ampere
    on, XLA's and float16 before; the machine's own devices otherwise."""
    for name, attention, precision in [("a100-3g.20gb", "cudnn", "bf16"),
                                       ("h100", "cudnn", "bf16"), ("v100-16gb", "xla", "fp16"),
                                       ("t4", "xla", "fp16")]:
        devices, limit, _ = dit.target_devices(name)
        token = dit.TARGET_DEVICES.set(devices)
        try:
            assert dit.attention_implementation(jnp.bfloat16, 64) == attention
            assert dit.default_precision() == precision
        finally:
            dit.TARGET_DEVICES.reset(token)
        assert limit == int(0.75 * dit.GPU_TARGETS[name][-2])
    assert dit.run_devices() == jax.devices()
    assert dit.attention_implementation(jnp.bfloat16, 64) == "xla"

# A V100: XLA's CUDA compiler takes 28 s of CPU for this model, where for an Ampere GPU or later (the
# MIG slice) it takes 101 s (the README's "Compiled for the target").
@slow
def test_target_gpu_compiles_a_tiny_run(capsys, monkeypatch):
    """A V100 16 GB: one device, float16 and XLA's attention, what a run may use of it as
    XLA_PYTHON_CLIENT_MEM_FRACTION sets it; XLA's CUDA compiler counts no FLOPs. For an H100, a
    matrix product compiles to cuBLAS."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    head, train, sample, decode, inception, encode = bench_target(
        capsys, "v100-16gb", *TINY_RUN, "--batch-size", "16")
    memory = dit.size_text(int(0.9 * dit.GPU_TARGETS["v100-16gb"][-2]))
    assert head.endswith(f"fp16, attention xla, compiled for 1 x Tesla V100-SXM2-16GB "
                         f"(v100-16gb): a run may use {memory} a device (0.9 of 15.77 GiB, "
                         f"XLA_PYTHON_CLIENT_MEM_FRACTION)"), head
    assert re.fullmatch(r"  train:   [\d.]+ MiB a device: fits \| [\d.e+]+ FLOP a device "
                        r"\(dit_flops' count\) \| at 25% of Tesla V100-SXM2-16GB's "
                        r"peak \(an estimate\): .*", train), train
    assert re.fullmatch(r"  sample:  .*: [\d.]+ MiB a device, fits", sample), sample
    # the programs around the model, at their own batches: the latents' 8x8 decoded to 64x64, the
    # FID Inception's 128 a device, prepare_imagenet100.py's 32 a device; each holds its weights
    # (the SD VAE's 83.7M parameters in float32 at fp16: it overflows in float16; the Inception's
    # 23.8M)
    programs = {"decode": (decode, r"SD VAE, 64x64 images, batch 16 \(16 a device at a time\)",
                           83.7),
                "FID": (inception, r"Inception \(adm\), batch 128", 23.8),
                "encode": (encode, r"SD VAE, prepare_imagenet100.py's, 64x64 images with their "
                                   r"flips, batch 32 of a host", 83.7)}
    for name, (line, what, millions) in programs.items():
        fields = re.fullmatch(rf"  {name}: +{what}: ([\d.]+) (MiB|GiB) a device, fits", line)
        assert fields, line
        assert float(fields[1]) * 2 ** {"MiB": 20, "GiB": 30}[fields[2]] > 4 * millions * 1e6
    # From Ampere on, XLA would multiply in Triton kernels of its own; dit.py's XLA_FLAGS ask for
    # cuBLAS (an H100's program, as the H200 of the README's Speed section runs it)
    h100 = jax.sharding.SingleDeviceSharding(dit.target_devices("h100")[0][0])
    x = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16, sharding=h100)
    w = jax.ShapeDtypeStruct((384, 1536), jnp.bfloat16, sharding=h100)
    program = jax.jit(lambda x, w: jax.nn.gelu(x @ w)).lower(x, w).compile().as_text()
    assert "__cublas" in program and "triton" not in program

@slow
def test_target_pixel_run_has_no_vae(capsys, monkeypatch):
    """A run on pixels (MNIST's 28x28x1) decodes and encodes nothing: its one program beside the
    model's is the FID Inception, of its images as they are. Nothing is compiled (the training
    step for a V100: 10 s); test_target_gpu_compiles_a_tiny_run compiles each program."""
    lowered = []
    monkeypatch.setattr(dit, "step_memory", lambda compiled, config, limit: (None, "not compiled"))
    monkeypatch.setattr(dit, "compiled_line", lambda name, compile, limit: lowered.append(name))
    dit.main(["bench", "--target", "v100-16gb", *TINY_RUN[:4], "--image-size", "28", "--channels",
              "1", "--batch-size", "16"])
    assert [name.split(":")[0] for name in lowered] == ["sample", "FID"]
    assert lowered[1] == "FID:     Inception (adm), batch 128"

def test_xla_flops_are_none_where_the_program_loops():
    """XLA counts a loop's body once: a program with a loop (a sampler's steps, micro-batches) has
    no count, one without has XLA's, 2 n^3 for a product of n x n matrices."""
    x = jnp.ones((64, 64))
    product = jax.jit(lambda x: x @ x).lower(x).compile()
    loop = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c @ x, None), x, None, length=4)[0])
    assert dit.xla_flops(product) == 2 * 64 ** 3
    assert dit.xla_flops(loop.lower(x).compile()) is None

def test_target_p100_refuses_fp16_in_one_line():
    """XLA's GPU compiler has no float16 products with float32 sums before Volta: on a P100 a run
    is float32 by default, and --precision fp16 ends in one line that says why."""
    with pytest.raises(dit.InputError, match=r"--precision fp16: XLA has no float16 products "
                       r"with float32 sums on a Tesla P100-SXM2-16GB \(compute capability 6\); "
                       r"use fp32"):
        dit.main(["bench", "--target", "p100", *TINY_RUN, "--precision", "fp16"])
    devices, _, _ = dit.target_devices("p100")
    assert dit.default_precision(devices[0]) == "fp32"

def test_target_without_its_compiler_says_what_to_install(monkeypatch):
    """jax[tpu] and jax[cuda12] are optional: without the one a target needs, one line."""
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    for target, extra in [("v3-8", "tpu"), ("a100-80gb", "cuda12")]:
        with pytest.raises(dit.InputError, match=re.escape(
                f'pip install "jax[{extra}]=={jax.__version__}"')):
            dit.main(["bench", "--target", target, *TINY_RUN])

def target_output(name):
    """The lines of fixtures/targets/NAME.txt: a `bench --target` command, then its output."""
    with open(fixture(os.path.join("targets", f"{name}.txt"))) as f:
        return f.read().splitlines()

# The README's tables of compiles for the course's hardware: a row a file of fixtures/targets (what
# a `bench --target` command printed; compile.sh beside them makes them), in this order.
TARGET_RUNS = ["v3-8", "v3-16", "v4-8", "v5e-1", "v5e-8", "v6e-1", "v6e-8", "h100-ddpm",
               "a100-80gb", "a100-40gb", "a40", "a100-3g.20gb", "a100-3g.20gb-.9", "v100-32gb",
               "v100-16gb", "t4", "p100"]
# and its table of DiT-XL/2 at the same batch
XL_TARGET_RUNS = ["h100-xl2", "v3-8-xl2", "v3-8-xl2-fsdp"]

def target_row(lines):
    """The README's row of one `bench --target` command's output: the command, then its lines."""
    command, head, train, *programs = lines
    target, *options = re.sub(r"--size \w+ --patch 2 --batch-size 256", "",
                              command.split("--target ")[1]).split(maxsplit=1)
    fraction = command.split()[1] if "MEM_FRACTION" in command else None
    devices = re.search(r"(\w+), attention (\w+).*, compiled for (\d+ x [^(]+) \(", head)
    may_use = re.search(r"a run may use ([\d.]+ [MG]iB) a device", head)[1]
    fits = re.fullmatch(r"  train: +([\d.]+ [MG]iB) a device: fits \| .*: (\d+) ms a step, "
                        r".*, 400K steps ([\d.]+ h)", train)
    if fits:
        step, hours = f"{fits[1]}: fits", f"{fits[2]} ms, {fits[3]}"
    else:
        needs = re.search(r"needs (?:([\d.]+ [MG]iB) of|(more than)) a device's", train)
        remedy = re.search(r"try --grad-accum (\d+) \(about ([\d.]+ [MG]iB)\)", train)
        step = (f"{needs[1] or 'refused'}: does not fit"
                + (f"; `--grad-accum {remedy[1]}`: {remedy[2]}" if remedy else ""))
        hours = ""
    memory = []
    for line in programs:
        figure = re.search(r": ([\d.]+ [MG]iB) a device, fits|\(([\d.]+ [MG]iB)\)", line)
        memory.append(figure[1] or f"{figure[2]}: does not fit")
    cells = [f"`{target}`" + "".join(f" `{o.strip()}`" for o in options)
             + (f", `{fraction}`" if fraction else "") + f": {devices[3].strip()}, {devices[1]}, "
             f"{devices[2]} attention", step, may_use, *memory, hours]
    return "| " + " | ".join(cells) + " |"

def test_readme_target_table_is_the_compiles():
    """The README's tables of compiles for the course's hardware, DiT-S/2's and DiT-XL/2's, are
    what `bench --target` printed for each target (fixtures/targets), row by row."""
    for heading, names in [("DiT-S/2 at the course's batch 256 on 32x32x4 latents", TARGET_RUNS),
                           ("DiT-XL/2 at the same batch", XL_TARGET_RUNS)]:
        table = readme_table(heading)
        assert [f"| {' | '.join(row)} |" for row in table] == [target_row(target_output(name))
                                                              for name in names]

# The README's hours on the notebooks' and the course's TPUs (the course's section): the compiled
# step's time at 25% of the slice's peak, a row a slice.
README_TPUS = {"v3-8": "TPU v3-8 (Kaggle)", "v3-16": "TPU v3-16", "v4-8": "TPU v4-8",
               "v5e-1": "TPU v5e-1 (Colab)", "v5e-8": "TPU v5e-8", "v6e-1": "TPU v6e-1 (Colab)",
               "v6e-8": "TPU v6e-8"}

def test_readme_tpu_hours_are_the_compiles():
    """The README's table of DiT-S/2's hours on TPUs is `bench --target`'s estimates for each
    slice: its step at 25% of the peak of all its devices."""
    assert readme_table("At the same 25%,\nthe course's step as it compiles") == tpu_hours_rows()

def tpu_hours_rows():
    rows = []
    for name, label in README_TPUS.items():
        head, train = target_output(name)[1:3]
        count, kind = re.search(r"compiled for (\d+) x (.+?) \(", head).groups()
        peak = int(count) * dit.PEAK_FLOPS[kind]
        step, *hours = re.search(r"(\d+) ms a step, 100K steps ([\d.]+ h), 400K steps ([\d.]+ h)",
                                 train).groups()
        rows.append([label, f"{peak / 1e12:,.0f} TFLOP/s",
                     f"{dit.ESTIMATE_MFU * peak / 1e12:,.0f} TFLOP/s", f"{step} ms", *hours])
    return rows

# The README's per-GPU table of the SLURM section quotes the compiles' figures of the training step
# as "`bench --target NAME`: the step counts A GiB of B".
def test_readme_gpu_memory_is_the_compiles():
    """Every row of the README's table of the cluster's GPUs gives the memory of the course's step
    that `bench --target` counted on that GPU, of what a run may use there."""
    rows = readme_table("**3. Per kind of GPU**")
    for row in rows:
        quoted = re.findall(r"`((?:XLA_PYTHON_CLIENT_MEM_FRACTION=.9 )?)bench --target (\S+)`: the "
                            r"step counts ([\d.]+ GiB) of ([\d.]+ GiB)", row[3])
        assert quoted, row
        for fraction, name, counted, may_use in quoted:
            head, train = target_output(name + ("-.9" if fraction else ""))[1:3]
            assert f"a run may use {may_use} a device" in head
            assert re.match(rf"  train: +(the training step needs )?{counted} ", train), train

@slow
def test_target_v3_8_course_run(capsys, monkeypatch):
    """The course's step on a TPU v3-8: DiT-S/2 at batch 256, 32 a core, as it compiles there. The
    programs around the model (the VAE's, the Inception's) take XLA's TPU compiler minutes whatever
    the model: their lines are checked in fixtures/targets/v3-8.txt, which the same command
    printed, and compiled for a GPU by the V100's test."""
    images = []
    monkeypatch.setattr(dit, "bench_target_images",
                        lambda config, mesh, *args: images.append(mesh.size))
    head, train, sample = bench_target(capsys, "v3-8", "--size", "S", "--patch", "2",
                                       "--batch-size", "256")
    assert images == [8]
    command, *committed = target_output("v3-8")
    assert command == "$ python dit.py bench --target v3-8 --size S --patch 2 --batch-size 256"
    assert committed[:3] == [head, train, sample]
    decode, inception, encode = committed[3:]
    assert "bf16, attention xla, compiled for 8 x TPU v3 (v3-8): a run may use 15.48 GiB" in head
    fields = re.fullmatch(r"  train:   ([\d.]+) GiB a device: fits \| ([\d.e+]+) FLOP a device "
                          r"\(XLA's count\) \| at 25% of TPU v3's peak \(an estimate\): \d+ ms a "
                          r"step, .*", train)
    assert fields, train
    # more than the state that each core holds whole (parameters, EMA, AdamW's two moments in
    # float32), less than a core's HBM; XLA's FLOPs within a few percent of the model's products
    assert 4 * 33e6 * 4 / 2**30 < float(fields[1]) < 15.48
    cfg = dit.DiTConfig(input_size=32, patch_size=2, in_channels=4, **dit.DIT_SIZES["S"])
    assert 1.0 < float(fields[2]) / (3 * dit.dit_flops(cfg) * 256 / 8) < 1.05
    # the sampler's 25 steps are a loop, whose body XLA counts once: no FLOPs
    assert re.fullmatch(r"  sample:  heun, 25 steps, guidance 1.5, batch 256: [\d.]+ MiB a "
                        r"device, fits", sample), sample
    # 256x256 images: 32 a core decoded, 128 a core through the Inception, the 32 a core of one
    # host's 8 that prepare_imagenet100.py encodes; XLA counts their FLOPs a core
    for line, what in [(decode, r"decode:  SD VAE, 256x256 images, batch 256 \(32 a device at a "
                                r"time\)"),
                       (inception, r"FID:     Inception \(adm\), batch 1024"),
                       (encode, r"encode:  SD VAE, prepare_imagenet100.py's, 256x256 images with "
                                r"their flips, batch 256 of a host")]:
        assert re.fullmatch(rf"  {what}: [\d.]+ [MG]iB a device, fits \| [\d.e+]+ FLOP a device",
                            line), line
