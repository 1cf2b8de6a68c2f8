"""Tests of training at scale: device and host equivalence, exact resume, crash safety, real data."""
import json
import os
import socket
import subprocess
import sys
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

import dit

HERE = os.path.dirname(os.path.abspath(__file__))


def data(name):
    d = os.environ.get("DIT_DATA")
    if not d or not os.path.exists(os.path.join(d, name)):
        pytest.skip(f"{name!r} needs $DIT_DATA (the shared real-image folder)")
    return os.path.join(d, name)


# Every run below trains this tiny model in a fresh process, so that the number of devices (set by
# XLA_FLAGS before jax starts) and jax.distributed can differ between runs.
DRIVER = """
import os, sys
sys.path.insert(0, {here!r})
import dit
dit.DIT_SIZES["T"] = dict(hidden_size=32, depth=2, num_heads=2)
{patch}
dit.main(sys.argv[1:])
"""


def run_dit(tmp_path, args, devices=1, patch="", check=True, env=None):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(here=HERE, patch=patch))
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", **(env or {})}
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"dit.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
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
    return ["--dataset", "folder", "--data-dir", data_dir, "--resolution", "8", "--size", "T", "--patch", "2",
            "--batch-size", "8", "--steps", str(steps), "--log-every", "1", "--ckpt-every", "3",
            "--sample-every", "1000", "--sample-steps", "2", "--final-fid", "0", "--run-dir", str(run_dir),
            "--lr", "1e-3", "--ema-decay", "0.9", *extra]


def final_state(run_dir):
    meta, arrays = dit.read_checkpoint(dit.list_checkpoints(run_dir)[-1])
    return meta, arrays


def assert_states_close(a, b, rtol=2e-5, atol=2e-6):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def test_one_device_equals_four_and_fsdp(tmp_path, folder_data):
    run_dit(tmp_path, train_args(folder_data, tmp_path / "one", 4), devices=1)
    run_dit(tmp_path, train_args(folder_data, tmp_path / "four", 4), devices=4)
    run_dit(tmp_path, train_args(folder_data, tmp_path / "fsdp", 4, ["--fsdp"]), devices=4)
    _, one = final_state(tmp_path / "one")
    _, four = final_state(tmp_path / "four")
    _, fsdp = final_state(tmp_path / "fsdp")
    assert int(one["step"]) == 4
    # the parameters moved: the comparison is not between two untouched initialisations
    start = nnx.state(dit.DiT(dit.config_from_json(final_state(tmp_path / "one")[0]["model"]),
                              rngs=nnx.Rngs(0)), nnx.Param).to_pure_dict()
    assert not np.allclose(one["params.blocks.0.attn.qkv.kernel"], np.asarray(start["blocks"][0]["attn"]["qkv"]["kernel"]))
    assert_states_close(one, four)
    assert_states_close(one, fsdp)


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_hosts_equal_one(tmp_path, folder_data):
    """2 processes x 2 devices joined by jax.distributed on localhost == 1 process x 4 devices."""
    run_dit(tmp_path, train_args(folder_data, tmp_path / "single", 4), devices=4)
    port = free_port()
    script = tmp_path / "driver.py"
    procs = [subprocess.Popen([sys.executable, str(script), *train_args(folder_data, tmp_path / "multi", 4),
                               "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                                   "JAX_PLATFORMS": "cpu"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    assert "4 devices, 2 processes" in outs[0]
    _, single = final_state(tmp_path / "single")
    _, multi = final_state(tmp_path / "multi")
    assert_states_close(single, multi)


# Stops the process dead (no cleanup, like SIGKILL) right after the checkpoint of step 3 is written.
KILL_AFTER_CHECKPOINT = """
save = dit.save_checkpoint
def save_then_die(run_dir, state, meta, keep):
    save(run_dir, state, meta, keep)
    if int(state["step"]) == 3:
        os._exit(9)
dit.save_checkpoint = save_then_die
"""

# Kills the process in the middle of writing the checkpoint of step 6: half of it is on disk.
KILL_WHILE_WRITING = """
import signal
import numpy as np
savez = np.savez
def savez_and_die(f, **arrays):
    if int(arrays["step"]) == 6:
        f.write(b"PK\\x03\\x04" + bytes(1000))
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    savez(f, **arrays)
np.savez = savez_and_die
"""


def test_resume_is_exact_after_kill(tmp_path, folder_data):
    """6 uninterrupted steps == 3 steps, a kill, 3 resumed steps, bit for bit."""
    run_dit(tmp_path, train_args(folder_data, tmp_path / "straight", 6))
    killed = run_dit(tmp_path, train_args(folder_data, tmp_path / "resumed", 6), patch=KILL_AFTER_CHECKPOINT,
                     check=False)
    assert killed.returncode == 9
    assert [os.path.basename(p) for p in dit.list_checkpoints(tmp_path / "resumed")] == ["step_0000003.npz"]
    out = run_dit(tmp_path, train_args(folder_data, tmp_path / "resumed", 6))
    assert "resumed" in out.stdout
    _, a = final_state(tmp_path / "straight")
    _, b = final_state(tmp_path / "resumed")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # the log holds each step once: the resumed run appends where the killed one stopped
    steps = [json.loads(line)["step"] for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_kill_while_writing_checkpoint_leaves_one_that_resumes(tmp_path, folder_data):
    run_dit(tmp_path, train_args(folder_data, tmp_path / "straight", 9))
    run_dir = tmp_path / "crashed"
    killed = run_dit(tmp_path, train_args(folder_data, run_dir, 9), patch=KILL_WHILE_WRITING, check=False)
    assert killed.returncode == -9
    names = sorted(os.listdir(run_dir / "checkpoints"))
    assert "step_0000003.npz" in names and "step_0000006.npz" not in names
    assert any(".tmp" in n for n in names)  # the half-written file is there, under its temporary name
    out = run_dit(tmp_path, train_args(folder_data, run_dir, 9))
    assert "resumed" in out.stdout and "step_0000003.npz" in out.stdout
    _, a = final_state(tmp_path / "straight")
    _, b = final_state(run_dir)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_loss_falls_on_mnist(tmp_path):
    run_dit(tmp_path, ["--dataset", "mnist", "--data-dir", data("mnist"), "--size", "T", "--patch", "4",
                       "--batch-size", "32", "--steps", "60", "--log-every", "10", "--ckpt-every", "60",
                       "--sample-every", "60", "--sample-steps", "4", "--final-fid", "0", "--lr", "1e-3",
                       "--run-dir", str(tmp_path / "run")])
    loss = losses(tmp_path / "run")
    assert loss[-1] < 0.75 * loss[0], loss
    grid = np.asarray(Image.open(tmp_path / "run" / "samples" / "step_0000060.png"))
    assert grid.ndim == 2 and grid.shape[0] > 28  # a grayscale grid of several digits


def test_loss_falls_on_cifar10_photos(tmp_path):
    root = tmp_path / "cifar"
    with tarfile.open(data("cifar10-jpeg.tar.gz")) as tar:
        taken = {}
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and len(parts) == 4 and parts[1] == "train" and taken.get(parts[2], 0) < 20:
                taken[parts[2]] = taken.get(parts[2], 0) + 1
                os.makedirs(root / parts[2], exist_ok=True)
                (root / parts[2] / parts[3]).write_bytes(tar.extractfile(m).read())
            if len(taken) == 10 and all(v == 20 for v in taken.values()):
                break
    run_dit(tmp_path, ["--dataset", "folder", "--data-dir", str(root), "--size", "T", "--patch", "4",
                       "--batch-size", "32", "--steps", "60", "--log-every", "10", "--ckpt-every", "60",
                       "--sample-every", "60", "--sample-steps", "4", "--final-fid", "0", "--lr", "1e-3",
                       "--run-dir", str(tmp_path / "run")])
    loss = losses(tmp_path / "run")
    assert loss[-1] < 0.75 * loss[0], loss
    meta, _ = final_state(tmp_path / "run")
    assert meta["model"]["num_classes"] == 10 and meta["model"]["in_channels"] == 3


def test_bad_inputs_get_clear_errors(tmp_path, folder_data):
    # a batch that does not split over the devices
    out = run_dit(tmp_path, train_args(folder_data, tmp_path / "a", 2, ["--batch-size", "6"]), devices=4, check=False)
    assert out.returncode != 0 and "does not split over 4 devices" in out.stderr
    # a run directory holding another run
    run_dit(tmp_path, train_args(folder_data, tmp_path / "b", 1))
    out = run_dit(tmp_path, train_args(folder_data, tmp_path / "b", 2, ["--objective", "ddpm"]), check=False)
    assert out.returncode != 0 and "holds another run" in out.stderr and "objective" in out.stderr
    # a checkpoint of another model size
    meta, arrays = final_state(tmp_path / "b")
    cfg = dit.DiTConfig(**{**meta["model"], "hidden_size": 64, "num_heads": 2})
    tx, _ = dit.make_optimizer(1e-4)
    _, state, shardings = dit.init_state(cfg, tx, 0, dit.make_mesh(), False, jnp.float32, False)
    with pytest.raises(ValueError, match="another model size"):
        dit.restore_state(arrays, state, shardings, "that checkpoint")
    # a missing dataset
    out = run_dit(tmp_path, ["--dataset", "imagenet100", "--data-dir", str(tmp_path / "nowhere"),
                             "--run-dir", str(tmp_path / "c")], check=False)
    assert out.returncode != 0 and "prepare_imagenet100.py" in out.stderr


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, folder_data):
    # From step 5 on, the data holds an infinity: the loss of step 5 is the first that is not finite.
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
    assert [os.path.basename(p) for p in dit.list_checkpoints(tmp_path / "run")] == ["step_0000003.npz"]
    _, arrays = final_state(tmp_path / "run")
    assert all(np.isfinite(v).all() for v in arrays.values())


def test_export_sample_and_fid_samples(tmp_path, folder_data):
    run_dir = tmp_path / "run"
    run_dit(tmp_path, train_args(folder_data, run_dir, 3))
    ckpt = dit.list_checkpoints(run_dir)[-1]
    # the exported EMA weights give the same model as the checkpoint's EMA
    m1, obj1, _ = dit.load_model(ckpt)
    m2, obj2, _ = dit.load_model(str(run_dir / "ema.safetensors"))
    x, t, y = jax.random.normal(jax.random.key(0), (2, 8, 8, 3)), jnp.array([10.0, 900.0]), jnp.array([0, 1])
    assert obj1 == obj2 and obj1["name"] == "rf"
    np.testing.assert_array_equal(np.asarray(m1(x, t, y)), np.asarray(m2(x, t, y)))
    _, arrays = dit.read_checkpoint(ckpt)
    np.testing.assert_array_equal(np.asarray(m1.blocks[1].mlp.fc2.kernel[...]), arrays["ema.blocks.1.mlp.fc2.kernel"])
    # a grid, and FID samples with labels spread evenly over the classes
    run_dit(tmp_path, ["sample", "--ckpt", ckpt, "--steps", "3", "--n", "4", "--out", str(tmp_path / "g.png"),
                       "--gif", str(tmp_path / "g.gif")], devices=2)
    assert Image.open(tmp_path / "g.png").size == (2 * 10 + 2, 2 * 10 + 2)
    assert Image.open(tmp_path / "g.gif").n_frames > 3
    run_dit(tmp_path, ["sample", "--ckpt", ckpt, "--steps", "3", "--fid", "10", "--batch-size", "4",
                       "--out", str(tmp_path / "s.npz")], devices=2)
    with np.load(tmp_path / "s.npz") as f:
        assert f["arr_0"].shape == (10, 8, 8, 3) and f["arr_0"].dtype == np.uint8
        assert np.bincount(f["labels"]).tolist() == [5, 5]


def test_bench_reports_figures(tmp_path):
    out = run_dit(tmp_path, ["bench", "--size", "T", "--patch", "2", "--image-size", "8", "--batch-size", "8",
                             "--precision", "fp32", "--steps", "2"], devices=2)
    assert "images/s" in out.stdout and "ms/step" in out.stdout and "MFU" in out.stdout


def test_flops_match_the_paper():
    """Table 4 of the paper gives forward Gflops (multiply-adds) of the twelve models at 256x256."""
    paper = {"S/8": 0.36, "S/4": 1.41, "S/2": 6.06, "B/8": 1.42, "B/4": 5.56, "B/2": 23.01,
             "L/8": 5.01, "L/4": 19.70, "L/2": 80.71, "XL/8": 7.39, "XL/4": 29.05, "XL/2": 118.64}
    for name, gflops in paper.items():
        assert dit.dit_flops(dit.dit_config(name)) / 2e9 == pytest.approx(gflops, rel=0.01), name
