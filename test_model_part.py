"""Tests of the DiT model against the official facebookresearch/DiT (dit_reference.{pt,npz})."""
import dataclasses
import json
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dit
from fid import UnsafePickleError

HERE = os.path.dirname(os.path.abspath(__file__))


def fixture(name):
    """Path of a reference file: $DIT_FIXTURES first, then the project's fixtures/; skip if in neither."""
    for d in (os.environ.get("DIT_FIXTURES"), os.path.join(HERE, "fixtures")):
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    pytest.skip(f"reference file {name!r} is in neither $DIT_FIXTURES nor fixtures/")


def rel_err(ours, ref):
    return float(np.linalg.norm(np.asarray(ours, np.float64) - ref) / np.linalg.norm(ref))


def nhwc(a):
    return jnp.asarray(a.transpose(0, 2, 3, 1))


def nchw(a):
    return np.asarray(a).transpose(0, 3, 1, 2)


@pytest.fixture(scope="module")
def reference():
    ref = np.load(fixture("dit_reference.npz"))
    cfg = dit.DiTConfig(**json.loads(str(ref["config"])))
    return ref, cfg, dit.load_dit_checkpoint(fixture("dit_reference.pt"), cfg)


def test_model_output_matches_official(reference):
    ref, _, model = reference
    out = model(nhwc(ref["x"]), jnp.asarray(ref["t"]), jnp.asarray(ref["y"]))
    assert rel_err(nchw(out), ref["out"]) < 1e-5


def test_cfg_forward_matches_official(reference):
    ref, _, model = reference
    out = model.forward_with_cfg(nhwc(ref["cfg_x"]), jnp.asarray(ref["cfg_t"]), jnp.asarray(ref["cfg_y"]),
                                 float(ref["cfg_scale"]), guidance_channels=3)
    assert rel_err(nchw(out), ref["cfg_out"]) < 1e-5


def test_cfg_all_channels_and_interval(reference):
    """Guidance on all channels changes the 4th noise channel and never the variance; outside the
    guidance interval the output is the conditional prediction."""
    ref, cfg, model = reference
    x, t, y = nhwc(ref["cfg_x"]), jnp.asarray(ref["cfg_t"]), jnp.asarray(ref["cfg_y"])
    three = np.asarray(model.forward_with_cfg(x, t, y, 4.0, guidance_channels=3))
    every = np.asarray(model.forward_with_cfg(x, t, y, 4.0))
    C = cfg.in_channels
    np.testing.assert_array_equal(three[..., :3], every[..., :3])
    assert not np.allclose(three[..., 3], every[..., 3])
    np.testing.assert_array_equal(three[..., C:], every[..., C:])
    half = x[:2]
    cond = np.asarray(model(jnp.concatenate([half, half]), t, y))
    outside = np.asarray(model.forward_with_cfg(x, t, y, 4.0, interval=(300.0, 1000.0)))  # t = 250 is outside
    np.testing.assert_allclose(outside[:2], cond[:2], rtol=1e-6, atol=1e-6)
    inside = np.asarray(model.forward_with_cfg(x, t, y, 4.0, interval=(200.0, 1000.0)))
    np.testing.assert_allclose(inside, every, rtol=1e-6, atol=1e-6)


def test_position_table_is_the_official_one(reference):
    ref, cfg, _ = reference
    state = dit.load_torch(fixture("dit_reference.pt"))
    np.testing.assert_allclose(dit.sincos_pos_embed_2d(cfg.hidden_size, *cfg.grid), state["pos_embed"][0], atol=1e-6)


def test_config_is_inferred_from_official_sizes(reference, tmp_path):
    ref, cfg, _ = reference
    with pytest.raises(ValueError, match="pass a DiTConfig"):  # hidden size 96 is not an official size
        dit.load_dit_checkpoint(fixture("dit_reference.pt"))
    state = dit.load_torch(fixture("dit_reference.pt"))
    inferred = dit.infer_dit_config({**state, "x_embedder.proj.weight": np.zeros((384, 4, 2, 2), np.float32)})
    assert (inferred.num_heads, inferred.depth, inferred.num_classes, inferred.learn_sigma) == (6, cfg.depth, 10, True)
    assert (inferred.input_size, inferred.patch_size, inferred.in_channels) == (16, 2, 4)


def test_wrong_size_checkpoint_is_refused(reference):
    _, cfg, _ = reference
    with pytest.raises(ValueError, match="another model size"):
        dit.load_dit_checkpoint(fixture("dit_reference.pt"), dataclasses.replace(cfg, mlp_ratio=2.0))
    with pytest.raises(ValueError, match="lacks"):
        dit.load_dit_checkpoint(fixture("dit_reference.pt"), dataclasses.replace(cfg, depth=cfg.depth + 1))


def test_parameter_counts_equal_the_official_ones():
    """The official counts (32,963,360 for DiT-S/2 and 675,129,632 for DiT-XL/2) include the fixed
    position table, which PyTorch stores as a frozen parameter. XL/2 is never allocated."""
    for name, official in [("S/2", 32_963_360), ("XL/2", 675_129_632)]:
        cfg = dit.dit_config(name)
        model = nnx.eval_shape(lambda: dit.DiT(cfg, rngs=nnx.Rngs(0)))
        T = cfg.grid[0] * cfg.grid[1]
        assert dit.count_params(model) + T * cfg.hidden_size == official, name


def test_official_initialisation():
    cfg = dit.DiTConfig(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4, num_classes=10)
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
    assert np.abs(qkv).max() <= np.sqrt(6 / (64 + 192)) and np.abs(qkv).max() > 0.9 * np.sqrt(6 / (64 + 192))
    patch = np.asarray(model.x_embedder.proj.kernel[...])  # fan-in is the flattened 2x2x4 patch
    assert np.abs(patch).max() <= np.sqrt(6 / (16 + 64)) and np.abs(patch).max() > 0.8 * np.sqrt(6 / (16 + 64))
    assert model.y_embedder.embedding_table.embedding[...].shape == (11, 64)  # the extra null label


def test_any_input_size_channels_and_unconditional():
    cfg = dit.DiTConfig(input_size=(8, 12), patch_size=4, in_channels=1, hidden_size=32, depth=1, num_heads=2,
                        num_classes=0, learn_sigma=False)
    model = dit.DiT(cfg, rngs=nnx.Rngs(0))
    assert not hasattr(model, "y_embedder")
    assert model(jnp.ones((3, 8, 12, 1)), jnp.ones(3), jnp.zeros(3, jnp.int32)).shape == (3, 8, 12, 1)
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        dit.DiTConfig(input_size=10, patch_size=4).grid


def test_label_dropout_uses_the_null_label(reference):
    _, cfg, model = reference
    y = jnp.arange(64) % cfg.num_classes
    emb = model.y_embedder(y, jax.random.key(0))
    null = model.y_embedder.embedding_table.embedding[...][cfg.num_classes]
    dropped = np.all(np.isclose(np.asarray(emb), np.asarray(null)), axis=1)
    assert 0 < dropped.sum() < 64 * 0.3  # class_dropout_prob 0.1 of 64
    np.testing.assert_array_equal(np.asarray(model.y_embedder(y)), np.asarray(model.y_embedder.embedding_table(y)))


def test_remat_and_bf16_match_fp32(reference):
    ref, cfg, model = reference
    x, t, y = nhwc(ref["x"]), jnp.asarray(ref["t"]), jnp.asarray(ref["y"])
    params = nnx.state(model, nnx.Param)
    graphdef = nnx.graphdef(model)
    remat = nnx.graphdef(dit.DiT(cfg, remat=True, rngs=nnx.Rngs(0)))
    half = nnx.graphdef(dit.DiT(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))

    def loss(g, p):
        return jnp.mean(nnx.merge(g, p)(x, t, y) ** 2)

    l0, g0 = jax.jit(jax.value_and_grad(lambda p: loss(graphdef, p)))(params)
    l1, g1 = jax.jit(jax.value_and_grad(lambda p: loss(remat, p)))(params)
    l2, _ = jax.jit(jax.value_and_grad(lambda p: loss(half, p)))(params)
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert float(l2) == pytest.approx(float(l0), rel=2e-2)  # bfloat16 keeps 8 bits of mantissa


def test_everything_jit_compiles(reference):
    ref, _, model = reference
    f = nnx.jit(lambda m, x, t, y: m.forward_with_cfg(x, t, y, 1.5, guidance_channels=3))
    out = f(model, nhwc(ref["cfg_x"]), jnp.asarray(ref["cfg_t"]), jnp.asarray(ref["cfg_y"]))
    assert out.shape == nhwc(ref["cfg_out"]).shape


def test_checkpoint_loader_refuses_code(tmp_path):
    """A .pt whose pickle would call os.system is refused by name, and the command never runs."""
    import zipfile
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", pickle.dumps({"x_embedder.proj.weight": Evil()}, protocol=2))
    with pytest.raises(UnsafePickleError, match="system"):
        dit.load_dit_checkpoint(str(path))
    assert not marker.exists()
