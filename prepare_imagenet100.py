"""Turn the Kaggle ImageNet-100 download (or any class-folder tree) into what
`dit.py --dataset imagenet100` trains on: Stable Diffusion VAE latents of every centre-cropped image
and of its mirror image, labels, class names, FID reference statistics and a manifest.

    python prepare_imagenet100.py ~/data/imagenet100 ~/data/in100-256
        # train split, 256x256
    python prepare_imagenet100.py ~/data/imagenet100 ~/data/in100-256 --split val
        # into ~/data/in100-256/val
    python prepare_imagenet100.py ~/data/imagenet100 ~/data/in100-px64 --pixels 64
        # uint8 pixels, no VAE

Output (in OUT, or OUT/val for --split val):
    latents.npy     float16 (N, 2, h, w, 2C): axis 1 = [image, horizontal flip], last axis =
                    [posterior mean, posterior std] in the raw VAE latent space, so that the trainer
                    can draw z = (mean + std * eps) * scaling_factor afresh at every step, as DiT's
                    train.py does
    images.npy      instead of latents.npy with --pixels R: uint8 (N, R, R, 3)
    labels.npy      int64 (N,)
    classes.json    [{"wnid": ..., "name": ...}] in label order (sorted wnids, names from
                    Labels.json)
    fid_stats.npz   mu, sigma of the Inception features of the cropped images, pytorch-fid's
                    protocol and layout (unless --no-fid)
    fid_ref.npz     the same images as a reference batch of OpenAI's evaluator (the adm
                    protocol): FID and sFID statistics and the pool features of 10,000 of them for
                    Precision and Recall (`python fid.py ref`'s layout; unless --no-fid)
    manifest.json   settings, counts, skipped files and why, warnings, finished chunks, timing

The work is done in chunks; an interrupted run started again with the same arguments skips the
chunks that the manifest lists as finished. The VAE's products run at --precision: by default at the
fastest that stores the float32 latents to float16's rounding (high on TPUs, float32 elsewhere).

On a pod slice, whose hosts have only local disks, run the same command on every host, for instance
    gcloud compute tpus tpu-vm ssh NAME --worker=all --command="python prepare_imagenet100.py ..."
with the source copied to each host first. Each host prepares the whole split with its own devices
onto its own disk and waits for no other, also where jax.distributed joined the processes, so that
every host ends with the complete data.
"""
import argparse
import concurrent.futures
import functools
import hashlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import fid
import dit
from dit import image_files, load_image, load_vae, read_json, tqdm, write_atomically

EXPECTED_IMAGES = {"train": 126_689, "val": 5_000}  # the Kaggle ambityga/imagenet100 release
EXPECTED_CLASSES = 100

#################################################################################
#                           Finding and reading images                          #
#################################################################################

def find_images(src, split, classes=None):
    """List the images of a split, as dit.image_files finds them. The Kaggle layout keeps the
    training classes in train.X1 ... train.X4 and validation in val.X; without train.X* folders
    `src` itself is taken as the class-folder tree. `classes` (wnids in label order) pins the
    labels, so that val uses train's. Returns (classes, files, labels, warnings), files relative
    to `src` and sorted, which fixes the order chunks are cut in."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"source folder {src} does not exist")
    if split == "val":
        roots = ["val.X"]
        if not os.path.isdir(os.path.join(src, "val.X")):
            raise FileNotFoundError(f"{src} has no val.X folder; --split val needs the Kaggle "
                                    f"layout")
    else:
        roots = sorted(d for d in os.listdir(src)
                       if d.startswith("train.X") and os.path.isdir(os.path.join(src, d)))
        roots = roots or ["."]
    class_files = {}  # wnid -> its images (the Kaggle split puts each class in one train.X*)
    for root in roots:
        for wnid, found in image_files(os.path.join(src, root))[1].items():
            class_files.setdefault(wnid, []).extend(os.path.relpath(f, src) for f in found)
    if not class_files:
        raise FileNotFoundError(f"no class folders under {[os.path.join(src, r) for r in roots]}; "
                                f"expected the Kaggle layout (train.X1..train.X4, val.X) or one "
                                f"folder per class")
    if classes is None:
        classes = sorted(class_files)
    elif extra := sorted(set(class_files) - set(classes)):
        raise dit.InputError(f"{split} has class folders that the training split lacks: {extra}; "
                             f"prepare the training split again with them, or {split} into "
                             f"another output folder")
    warnings, files, labels = [], [], []
    for label, wnid in enumerate(classes):
        names = class_files.get(wnid, [])
        if not names:
            warnings.append(f"class {wnid} has no images in the {split} split")
        files += names
        labels += [label] * len(names)
    expected = EXPECTED_IMAGES[split]
    if abs(len(files) - expected) > 0.01 * expected or len(classes) != EXPECTED_CLASSES:
        warnings.append(f"found {len(files)} files in {len(classes)} classes; the Kaggle "
                        f"ImageNet-100 {split} split has {expected} images in {EXPECTED_CLASSES} "
                        f"classes (expected if this is a custom tree, otherwise the download is "
                        f"incomplete)")
    return classes, files, np.asarray(labels, np.int64), warnings

def decoded_chunks(pool, src, files, chunks, size):
    """Yield (chunk, images (n, size, size, 3), reasons) in order, decoding the next chunk in the
    thread pool while the caller encodes the current one."""
    pending = None
    for c, (lo, hi) in chunks:
        futures = [pool.submit(load_image, os.path.join(src, f), size) for f in files[lo:hi]]
        if pending is not None:
            yield collect(*pending, size)
        pending = (c, futures)
    if pending is not None:
        yield collect(*pending, size)

def collect(c, futures, size):
    """Wait for one chunk's decoding: (chunk, images with zeros for broken files, {index in chunk:
    reason})."""
    images = np.zeros((len(futures), size, size, 3), np.uint8)
    reasons = {}
    for j, fut in enumerate(futures):
        arr, reason = fut.result()
        if reason is None:
            images[j] = arr
        else:
            reasons[j] = reason
    return c, images, reasons

#################################################################################
#                         Sharded encoding and features                         #
#################################################################################

DEVICE_BATCH = 32  # images a device encodes at a time, where --batch-size is not given

def sharded_program(graphdef, fn, data):
    """fn(model, images) of the model's state and images with the `data` sharding, jitted (dit.py's
    `bench --target` compiles it for a device that the machine lacks)."""
    return jax.jit(lambda state, x: fn(nnx.merge(graphdef, state), x), out_shardings=data)

def sharded_apply(model, fn, batch_shape, data):
    """Compile fn(model, images) now for uint8 images of batch_shape with the `data` sharding, the
    model replicated over its mesh. Returns run(images on the devices) -> device array."""
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, NamedSharding(data.mesh, PartitionSpec()))
    compiled = sharded_program(graphdef, fn, data).lower(
        state, jax.ShapeDtypeStruct(batch_shape, np.uint8, sharding=data)).compile()
    return functools.partial(compiled, state)

def encode_with_flip(vae, images, precision=None):
    """uint8 (B, R, R, 3) -> float16 (B, 2, h, w, 2C): [image, horizontal flip] x [posterior mean,
    std]. A float32 VAE's products run at jax's matmul `precision` (None: float32's)."""
    x = images.astype(jnp.float32) / 127.5 - 1.0  # DiT's Normalize(0.5, 0.5) after ToTensor's /255
    x = jnp.stack([x, x[:, :, ::-1]], axis=1)  # (B, 2, R, R, 3), flipped along W
    with jax.default_matmul_precision(precision):  # AutoencoderKL's float32 yields to it
        mean, logvar = vae.encode(x.reshape(-1, *x.shape[2:]))  # (2B, h, w, C) each
    out = jnp.concatenate([mean, jnp.exp(0.5 * logvar)], axis=-1)  # (2B, h, w, 2C)
    return out.reshape(*x.shape[:2], *out.shape[1:]).astype(jnp.float16)

#################################################################################
#                                   Main loop                                   #
#################################################################################

def write_json(path, obj):
    """Write atomically: a crash leaves either the old or the new file, never half of one."""
    write_atomically(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))

def is_manifest(m):
    """Whether `m` has what main and write_outputs use of an earlier run's manifest.json."""
    if not isinstance(m, dict):
        return False
    chunks, counts = m.get("chunks_done"), m.get("counts")
    return (isinstance(m.get("settings"), dict)
            and isinstance(m.get("seconds"), (int, float)) and isinstance(chunks, dict)
            and all(isinstance(chunk, dict) and all(isinstance(why, str) for why in chunk.values())
                    for chunk in chunks.values())
            and (not m.get("complete")
                 or isinstance(counts, dict) and isinstance(counts.get("images"), int)))

def open_partial(path, mode, dtype, shape):
    """A memory map of the rows being filled. One left by an interrupted run must be what this run
    would make, or the rows would land in the wrong places."""
    fix = "delete it to prepare this split again from the start"
    try:
        array = np.lib.format.open_memmap(path, mode, dtype, shape)
    except ValueError as e:  # a damaged header, or a file shorter than its header says
        raise dit.InputError(f"{path} from an interrupted run is damaged ({e}); {fix}") from None
    if array.dtype != dtype or array.shape != shape:
        raise dit.InputError(f"{path} from an interrupted run holds {array.dtype} {array.shape}, "
                             f"not {np.dtype(dtype)} {shape}; {fix}")
    return array

def parse_args(argv):
    p = dit.OneLineParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="Kaggle ImageNet-100 folder (train.X1..X4, val.X, Labels.json) or "
                   "class-folder tree")
    p.add_argument("out", help="output folder (the val split goes into OUT/val)")
    p.add_argument("--split", choices=["train", "val"], default="train")
    p.add_argument("--resolution", type=dit.positive_int, default=256,
                   help="centre-crop size the VAE encodes")
    p.add_argument("--pixels", type=dit.positive_int, metavar="R",
                   help="store uint8 R x R images instead of latents (no VAE)")
    p.add_argument("--vae", default="ema",
                   help="'ema', 'mse', a diffusers VAE folder or a weight file")
    p.add_argument("--batch-size", type=dit.positive_int,
                   help="encoding batch of this host, rounded up to a multiple of its device count "
                   "(default: 32 per device)")
    p.add_argument("--precision", choices=["default", "high", "highest"],
                   help="jax's precision of the VAE's float32 matrix products: highest is "
                   "float32; high is three bfloat16 passes on TPUs, default one; NVIDIA GPUs do "
                   "both in TF32 (default: high on TPUs, highest elsewhere: one bfloat16 or TF32 "
                   "pass strays beyond the float16 rounding of the stored latents)")
    p.add_argument("--chunk-size", type=dit.positive_int, default=2048,
                   help="images per resumable chunk")
    p.add_argument("--workers", type=dit.positive_int, default=os.cpu_count(),
                   help="image-decoding threads")
    p.add_argument("--no-fid", action="store_true", help="skip the FID reference statistics")
    p.add_argument("--inception",
                   help="pytorch-fid Inception weights (default: fid.py's cache/download)")
    return p.parse_args(argv)

def default_vae_precision(device):
    """jax's matmul precision that gives the stored float16 latents of float32's: "high" on TPUs,
    three bfloat16 passes per product, half the six of "highest". On NVIDIA GPUs "high" is TF32,
    as "default" is; both stray beyond float16's rounding, so they keep float32 ("highest")."""
    return "high" if device.platform == "tpu" else "highest"

def main(argv=None):
    args = parse_args(argv)
    args.batch_size = args.batch_size or DEVICE_BATCH * jax.local_device_count()
    args.precision = args.precision or default_vae_precision(jax.local_devices()[0])
    src, out = (os.path.abspath(args.src),
                os.path.join(args.out, "val") if args.split == "val" else args.out)
    size = args.pixels or args.resolution
    dit.writable(out, folder=True)
    manifest_path = os.path.join(out, "manifest.json")
    manifest = None
    if os.path.exists(manifest_path):
        manifest = read_json(manifest_path, is_manifest, "the manifest of a run of this program",
                             f"delete {out} to prepare this split again from the start")

    # val keeps train's labels when train was prepared first into the same OUT
    train_classes, labels_json = (os.path.join(args.out, "classes.json"),
                                  os.path.join(src, "Labels.json"))
    pinned = None
    if args.split == "val" and os.path.exists(train_classes):
        valid = lambda c: isinstance(c, list) and all(
            isinstance(e, dict) and isinstance(e.get("wnid"), str) for e in c)
        pinned = [c["wnid"] for c in read_json(train_classes, valid, 'a list of {"wnid", "name"}',
                                               "prepare the training split again")]
    classes, files, labels, warnings = find_images(src, args.split, pinned)
    names = {}
    if os.path.exists(labels_json):
        valid = lambda n: isinstance(n, dict) and all(isinstance(v, str) for v in n.values())
        names = read_json(labels_json, valid, "an object of wnid: class name",
                          "fix it, or delete it to name the classes by their wnids")
    settings = {"split": args.split, "source": src, "resolution": size, "pixels": bool(args.pixels),
                "vae": None if args.pixels else args.vae, "chunk_size": args.chunk_size,
                "fid": not args.no_fid, "inception": None if args.no_fid else args.inception,
                "files": len(files),
                "files_sha1": hashlib.sha1("\n".join(files).encode()).hexdigest()}
    if manifest and manifest["settings"] != settings:
        diff = {k: (manifest["settings"].get(k), v) for k, v in settings.items()
                if manifest["settings"].get(k) != v}
        which = "a finished" if manifest.get("complete") else "an unfinished"
        raise dit.InputError(f"{out} holds {which} run with other settings {diff} (old, new); "
                             f"rerun with the old arguments, or use another output folder (or "
                             f"delete {out}) to start over")
    if manifest and manifest.get("complete"):
        print(f"{out} is already complete ({manifest['counts']['images']} images); delete it to "
              f"prepare again")
        return manifest

    vae, latent_shape = None, None
    if args.pixels:
        name, dtype, row_shape = "images", np.uint8, (size, size, 3)
    else:
        vae = load_vae(args.vae)
        f = vae.cfg.downsampling
        if size % f:
            raise dit.InputError(f"--resolution {size} is not a multiple of the VAE's downsampling "
                                 f"factor {f}; pick one that is")
        latent_shape = [size // f, size // f, vae.cfg.latent_channels]
        name, dtype, row_shape = ("latents", np.float16,
                                  (2, size // f, size // f, 2 * vae.cfg.latent_channels))
    inception = None if args.no_fid else fid.load_inception(args.inception)
    # Printed once every input has loaded, so that a run failing on one ends in its one error line.
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)

    # One row per file, broken ones included (they are found while decoding); the final copy drops
    # those.
    # "inception": pytorch-fid's pool features; "adm": the adm protocol's pool and spatial ones
    partials = {name: (dtype, row_shape)} | ({} if args.no_fid else {
        "inception": (np.float32, (2048,)), "adm": (np.float32, (2048 + fid.SPATIAL_DIM,))})
    paths = {k: os.path.join(out, f"{k}.partial.npy") for k in partials}
    if not manifest or not all(os.path.exists(p) for p in paths.values()):
        manifest = {"settings": settings, "chunks_done": {}, "seconds": 0.0}
    mode = "r+" if manifest["chunks_done"] else "w+"
    arrays = {k: open_partial(paths[k], mode, dt, (len(files), *shape))
              for k, (dt, shape) in partials.items()}
    manifest.update(classes=len(classes), warnings=warnings, latent_shape=latent_shape,
                    scaling_factor=vae.cfg.scaling_factor if vae else None, complete=False)

    run = encode_chunks(args, src, files, size, vae, inception, arrays, name, manifest,
                        manifest_path)
    write_outputs(out, name, files, labels, classes, names, arrays, manifest, manifest_path, run)
    del arrays  # close the memory maps before deleting their files
    for p in paths.values():
        os.remove(p)
    print_summary(args, out, manifest)
    return manifest

def encode_chunks(args, src, files, size, vae, inception, arrays, name, manifest, manifest_path):
    """Fill the partial arrays chunk by chunk: arrays[name] with pixels or latents,
    arrays["inception"] and arrays["adm"] with the features of both protocols. Each finished chunk
    is recorded in the manifest with its unreadable files, after its rows are flushed to disk;
    chunks already recorded are skipped."""
    # This host's devices only: on a pod slice every host prepares the whole split on its own, and
    # no collective may wait for hosts that finish sooner or later.
    devices = jax.local_devices()
    data = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    # a whole number of images per device
    batch = -(-args.batch_size // len(devices)) * len(devices)
    # (compiled function of a uint8 batch on the devices, the array its rows go to)
    t0, steps = time.perf_counter(), []
    if vae is not None:
        encode = functools.partial(encode_with_flip, precision=args.precision)
        steps.append((sharded_apply(vae, encode, (batch, size, size, 3), data), arrays[name]))
    if inception is not None:
        pool3 = lambda net, images: net(images, "pytorch-fid")[0]  # (B, 2048)

        def adm(net, images):  # (B, 2048 + 17 * 17 * 7): pool and spatial features side by side
            pool, _, spatial = net(images, "adm")
            return jnp.concatenate([pool, spatial], axis=1)

        for fn, key in ((pool3, "inception"), (adm, "adm")):
            steps.append((sharded_apply(inception, fn, (batch, size, size, 3), data),
                          arrays[key]))
    compile_s = time.perf_counter() - t0

    todo = [(c, (c * args.chunk_size, min((c + 1) * args.chunk_size, len(files))))
            for c in range(-(-len(files) // args.chunk_size))
            if str(c) not in manifest["chunks_done"]]
    bar = tqdm(total=len(files), initial=len(files) - sum(hi - lo for _, (lo, hi) in todo),
               unit="img", desc=f"{args.split} {name}", smoothing=0.1)
    t0, processed, seconds_before = time.perf_counter(), 0, manifest["seconds"]
    pool = concurrent.futures.ThreadPoolExecutor(args.workers)

    def read_back(b, n, results):  # rows b..b+n of a dispatched batch; the padding's are dropped
        for result, dest in results:
            dest[b:b + n] = np.asarray(result)[:n]
        bar.update(n)

    try:
        for c, images, reasons in decoded_chunks(pool, src, files, todo, size):
            lo = c * args.chunk_size
            in_flight = None  # (b, n, results) of the batch dispatched last
            for b in range(lo, lo + len(images), batch):
                part = images[b - lo:b - lo + batch]
                if vae is None:
                    arrays[name][b:b + len(part)] = part
                results = []
                if steps:
                    padded = np.zeros((batch, size, size, 3), np.uint8)
                    padded[:len(part)] = part
                    x = jax.device_put(padded, data)  # one transfer, which every step reads
                    results = [(fn(x), dest) for fn, dest in steps]
                # JAX dispatches asynchronously: the devices work on this batch while the last one
                # is read back.
                if in_flight:
                    read_back(*in_flight)
                in_flight = b, len(part), results
            read_back(*in_flight)
            for array in arrays.values():
                array.flush()
            skipped = {files[lo + j]: why for j, why in reasons.items()}
            for file, why in skipped.items():
                tqdm.write(f"skipped {file}: {why}", file=sys.stderr)
            processed += len(images)
            manifest["chunks_done"][str(c)] = skipped
            manifest["seconds"] = seconds_before + time.perf_counter() - t0
            write_json(manifest_path, manifest)
    finally:  # on an interruption, do not wait for the decoding queued ahead
        pool.shutdown(cancel_futures=True)
    bar.close()
    run_s = time.perf_counter() - t0
    return {"compile_s": round(compile_s, 2), "last_run_s": round(run_s, 2),
            "precision": None if vae is None else args.precision,
            "last_run_images": processed,
            "last_run_images_per_s": round(processed / run_s, 2) if processed else None,
            "devices": len(devices), "device": devices[0].device_kind,
            "hosts": jax.process_count()}

def write_outputs(out, name, files, labels, classes, names, arrays, manifest, manifest_path, run):
    """Copy the rows of the readable files into `<name>.npy`, write labels, classes, the FID
    statistics and the completed manifest."""
    skipped = {file: why for chunk in manifest["chunks_done"].values()
               for file, why in chunk.items()}
    kept = np.flatnonzero([f not in skipped for f in files])
    if not len(kept):
        source = manifest["settings"]["source"]
        raise dit.InputError(f"none of the {len(files)} files under {source} could be read; the "
                             f"skipped files and why are in manifest.json")
    rows = arrays[name]
    final = np.lib.format.open_memmap(os.path.join(out, f"{name}.npy"), "w+", rows.dtype,
                                      (len(kept), *rows.shape[1:]))
    for i in range(0, len(kept), 4096):  # in blocks: all latents need not fit in memory
        final[i:i + 4096] = rows[kept[i:i + 4096]]
    final.flush()
    np.save(os.path.join(out, "labels.npy"), labels[kept])
    write_json(os.path.join(out, "classes.json"),
               [{"wnid": w, "name": names.get(w, w)} for w in classes])
    if "inception" in arrays:
        stats = fid.FeatureStats(2048)
        for i in range(0, len(kept), 4096):
            stats.update(arrays["inception"][kept[i:i + 4096]])
        fid.save_statistics(os.path.join(out, "fid_stats.npz"), *stats.mu_sigma())
        pool, spatial = fid.FeatureStats(2048), fid.FeatureStats(fid.SPATIAL_DIM)
        for i in range(0, len(kept), 4096):
            rows = arrays["adm"][kept[i:i + 4096]]
            pool.update(rows[:, :2048])
            spatial.update(rows[:, 2048:])
        (mu, sigma), (mu_s, sigma_s) = pool.mu_sigma(), spatial.mu_sigma()
        keep = kept[fid.evenly_spaced(len(kept), fid.REF_PR_IMAGES)]
        fid.save_reference(os.path.join(out, "fid_ref.npz"),
                           {"mu": mu, "sigma": sigma, "mu_s": mu_s, "sigma_s": sigma_s,
                            "pool": arrays["adm"][keep, :2048], "protocol": "adm"})

    counts = np.bincount(labels[kept], minlength=len(classes))
    manifest.update(
        complete=True, resolution=manifest["settings"]["resolution"],
        vae=manifest["settings"]["vae"],
        file=f"{name}.npy", shape=list(final.shape), dtype=final.dtype.name,
        counts={"files": len(files), "images": len(kept), "skipped": len(skipped),
                "classes": len(classes),
                "per_class_min": int(counts.min()), "per_class_max": int(counts.max())},
        skipped=[{"file": file, "reason": why} for file, why in sorted(skipped.items())],
        timing={**run, "total_s": round(manifest["seconds"], 2)})
    write_json(manifest_path, manifest)

def print_summary(args, out, manifest):
    for w in manifest["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    counts, run = manifest["counts"], manifest["timing"]
    print(f"{counts['images']} images in {counts['classes']} classes -> {out} ({counts['skipped']} "
          f"skipped, listed in manifest.json)")
    if run["last_run_images"]:
        work = "decode + crop" + (" + copy" if args.pixels else " + VAE encode")
        work += "" if args.no_fid else " + Inception"
        print(f"speed: {run['last_run_images_per_s']} images/s ({work}) on {run['devices']} x "
              f"{run['device']}, after {run['compile_s']} s of compilation")

if __name__ == "__main__":
    dit.run_cli(main)
