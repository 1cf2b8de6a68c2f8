"""Tests of the objectives and samplers: DDPM against the official DiT's numbers (dit_reference.npz),
rectified flow and the DDPM samplers against the mathematics of Gaussian data."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dit import GaussianDiffusion, RectifiedFlow, space_timesteps

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
    return jnp.asarray(np.asarray(a).transpose(0, 2, 3, 1))


def nchw(a):
    return np.asarray(a).transpose(0, 3, 1, 2)


#################################################################################
#                       Gaussian data: exact models                             #
#################################################################################
# Data x0 ~ N(M, S^2) in every dimension. Every noised variable below is a linear mix of x0 and an
# independent eps ~ N(0, 1), so (x0, eps, x_t) are jointly Gaussian and the ideal network outputs,
# conditional expectations given x_t, are affine in x_t: E[a | x_t] = E[a] + Cov(a, x_t) / Var(x_t) (x_t - E[x_t]).
# The exact transport from noise to data along any such deterministic flow is then the monotone affine
# map z -> M + S z, which gives a sample-by-sample target free of Monte-Carlo error.
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
    """E[eps | x_t] for x_t = sqrt(abar) x0 + sqrt(1 - abar) eps, abar looked up at the ORIGINAL timestep
    the model is given, plus a constant variance output. Fed respaced indices instead, it would be wrong."""
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


#################################################################################
#                             Rectified flow                                    #
#################################################################################

def moment_error(x, target):
    return abs(float(x.mean() - target.mean())) + abs(float(x.var() - target.var()))


def test_rf_euler_recovers_gaussian_and_converges(gaussian_noise):
    z, target = gaussian_noise
    rf = RectifiedFlow()
    errors = [moment_error(rf.sample(rf_exact_velocity, z, n, "euler"), target) for n in (2, 4, 8, 16, 32, 64, 128)]
    # first order: doubling the steps roughly halves the error
    for coarse, fine in zip(errors, errors[1:]):
        assert fine < 0.7 * coarse, errors
    x = rf.sample(rf_exact_velocity, z, 128, "euler")
    assert abs(float(x.mean()) - M) < MEAN_TOL
    assert abs(float(x.var()) - S ** 2) < VAR_TOL + 0.005  # Euler's remaining bias at 128 steps is ~0.003


def test_rf_heun_beats_euler_and_converges(gaussian_noise):
    z, target = gaussian_noise
    rf = RectifiedFlow()
    heun, euler = [], []
    for n in (2, 4, 8, 16):
        heun.append(moment_error(rf.sample(rf_exact_velocity, z, n, "heun"), target))
        euler.append(moment_error(rf.sample(rf_exact_velocity, z, n, "euler"), target))
    assert all(h < 0.5 * e for h, e in zip(heun, euler)), (heun, euler)
    assert all(fine < coarse for coarse, fine in zip(heun, heun[1:])), heun
    x = rf.sample(rf_exact_velocity, z, 16, "heun")
    assert abs(float(x.mean()) - M) < MEAN_TOL
    assert abs(float(x.var()) - S ** 2) < VAR_TOL


def test_rf_trajectory(gaussian_noise):
    z = gaussian_noise[0][:8]
    x, traj = RectifiedFlow().sample(rf_exact_velocity, z, 5, "heun", return_trajectory=True)
    assert traj.shape == (6,) + z.shape
    np.testing.assert_array_equal(traj[0], z)
    np.testing.assert_array_equal(traj[-1], x)


@pytest.mark.parametrize("sampling,loc,scale", [("logit_normal", 0.0, 1.0), ("uniform", 0.0, 1.0)])
def test_rf_loss_of_exact_field(sampling, loc, scale):
    """The exact field's expected loss is E_t[Var(eps - x0 | x_t)] = E_t[1 + S^2 - Cov^2 / Var(x_t)], and
    any other field does worse."""
    rf = RectifiedFlow(sampling, loc, scale)
    x0 = M + S * jax.random.normal(jax.random.PRNGKey(1), (4096, 4, 4, 1))
    key = jax.random.PRNGKey(2)
    loss = float(rf.training_losses(rf_exact_velocity, x0, key)["loss"].mean())

    # the expectation over t by quadrature: t = sigmoid(loc + scale n) with Gauss-Hermite nodes n, or uniform
    if sampling == "logit_normal":
        nodes, weights = np.polynomial.hermite_e.hermegauss(80)
        t, w = 1 / (1 + np.exp(-(loc + scale * nodes))), weights / weights.sum()
    else:
        t = (np.arange(10000) + 0.5) / 10000
        w = np.full_like(t, 1 / len(t))
    residual = 1 + S ** 2 - (t - (1 - t) * S ** 2) ** 2 / ((1 - t) ** 2 * S ** 2 + t ** 2)
    expected = float(np.sum(w * residual))
    assert abs(loss - expected) < 0.02 * expected, (loss, expected)

    wrong = float(rf.training_losses(lambda x, t: rf_exact_velocity(x, t, m=M + 0.3), x0, key)["loss"].mean())
    assert wrong > loss + 0.05


def test_rf_timestep_distributions():
    n = 20000
    loc, scale = 0.5, 1.2
    t = np.asarray(RectifiedFlow("logit_normal", loc, scale).sample_timesteps(jax.random.PRNGKey(3), n))
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
        rf.sample(learned_sigma_model, x, 2)
    with pytest.raises(ValueError, match="'euler' or 'heun'"):
        rf.sample(rf_exact_velocity, x, 2, method="rk4")
    with pytest.raises(ValueError, match="positive int"):
        rf.sample(rf_exact_velocity, x, 0)
    with pytest.raises(ValueError, match="timestep_sampling"):
        RectifiedFlow("cosine")


#################################################################################
#                   DDPM: schedule, respacing, mathematics                      #
#################################################################################

def test_space_timesteps_examples():
    # the DDIM striding: every k-th step from 0
    assert space_timesteps(1000, "ddim25") == list(range(0, 1000, 40))
    assert space_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    assert space_timesteps(1000, "1000") == list(range(1000))
    # the official docstring's example: 300 steps in sections of 100 taking 10, 15 and 20 steps, each
    # section's first and last step included
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


def test_p_mean_variance_mathematics():
    """Given the true noise, the x_0 prediction inverts q(x_t | x_0); the variance output -1 / +1 selects
    the posterior variance / beta_t (Nichol & Dhariwal eq. 15); the mean is the posterior mean."""
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
        out = diffusion.p_mean_variance(jnp.concatenate([noise, jnp.full_like(noise, v)], -1), jnp.asarray(x_t), t)
        np.testing.assert_allclose(out["pred_xstart"], x0, atol=2e-4)
        np.testing.assert_allclose(out["log_variance"][:, 0, 0, 0], np.log(want_var[np.asarray(t)]), rtol=1e-5)
    # posterior mean of q(x_{t-1} | x_t, x_0), Ho et al. eq. 7
    bt, abp = betas[np.asarray(t)].reshape(-1, 1, 1, 1), ab_prev[np.asarray(t)].reshape(-1, 1, 1, 1)
    mean = np.sqrt(abp) * bt / (1 - abt) * x0 + np.sqrt(1 - bt) * (1 - abp) / (1 - abt) * x_t
    np.testing.assert_allclose(out["mean"], mean, atol=2e-4)


def test_vb_trains_only_the_variance():
    """The stop-gradient on the mean: d vb / d eps = 0 and d mse / d variance = 0 (official `frozen_out`)."""
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
        x = GaussianDiffusion(f"ddim{steps}").sample(model_fn, z, method="ddim")
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
                                         return_trajectory=True)
    assert traj.shape == (1001,) + z.shape
    np.testing.assert_array_equal(traj[-1], x)
    assert abs(float(x.mean()) - M) < MEAN_TOL
    assert abs(float(x.var()) - S ** 2) < 2 * VAR_TOL


def test_ddpm_rejects_bad_input():
    diffusion = GaussianDiffusion("10")
    x = jnp.zeros((2, 4, 4, 3))
    with pytest.raises(ValueError, match="learn_sigma=True"):
        diffusion.sample(lambda x, t: x, x, method="ddim")
    with pytest.raises(ValueError, match="PRNG key"):
        diffusion.sample(ddpm_exact_model(0.0), x, method="ddpm")
    with pytest.raises(ValueError, match="'ddpm' or 'ddim'"):
        diffusion.sample(ddpm_exact_model(0.0), x, jax.random.PRNGKey(0), method="plms")


#################################################################################
#                     DDPM against the official DiT                             #
#################################################################################

@pytest.fixture(scope="module")
def ref():
    return np.load(fixture("dit_reference.npz"))


@pytest.fixture(scope="module")
def model(ref):
    import dit
    cfg = dit.DiTConfig(**json.loads(str(ref["config"])))
    return dit.load_dit_checkpoint(fixture("dit_reference.pt"), cfg)


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
    out = model(x, jnp.asarray(diffusion.timestep_map[np.asarray(index)], jnp.float32), jnp.asarray(ref["p250_y"]))
    p = diffusion.p_mean_variance(out, x, index)
    for name in ("mean", "log_variance", "pred_xstart"):
        assert rel_err(nchw(p[name]), ref[f"p250_{name}"]) < 1e-5, name


def test_ddim25_with_cfg(ref, model):
    diffusion = GaussianDiffusion("ddim25")
    np.testing.assert_array_equal(diffusion.timestep_map, ref["ddim25_timestep_map"])
    y, scale = jnp.asarray(ref["ddim25_y"]), float(ref["ddim25_cfg_scale"])
    model_fn = lambda x, t: model.forward_with_cfg(x, t, y, scale, guidance_channels=3)  # noqa: E731
    x = diffusion.sample(model_fn, nhwc(ref["ddim25_noise"]), method="ddim")
    assert rel_err(nchw(x), ref["ddim25_out"]) < 1e-4
