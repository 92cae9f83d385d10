"""Reference implementations shared by the tests: dense oracles written the slow, obvious way."""

import numpy as np

# The tests compile many small programs and run each a few steps: XLA's CPU backend compiles them faster at
# LLVM's lowest optimization level and with its older fusion emitters (an optimizer's step of the tests' small
# transformer: 1.6-2.0 s against 4.4-5.2 s with the MLIR fusion emitters; same operations; a test that compares two
# runs compiles both so).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false")


# the environment variable naming the test run's folder (made by tests/conftest.py in the process pytest was started
# as; xdist's workers and the processes tests start inherit it): the compilation cache and the shared reference runs
RUN_DIR = "SCSGD_JAX_TESTS_RUN_DIR"


def shared_run(name, make):
  """The folder ``make(folder)`` filled once per test run, by whichever xdist worker asks first (the other waits on
  a file lock): a reference run several tests compare with, made once however the tests are spread."""
  import fcntl
  import os
  import shutil

  root = os.path.join(os.environ[RUN_DIR], "shared")
  os.makedirs(root, exist_ok=True)
  folder = os.path.join(root, name)
  with open(folder + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(folder + ".done"):
      shutil.rmtree(folder, ignore_errors=True)
      os.makedirs(folder)
      make(folder)
      open(folder + ".done", "w").close()
  return folder


def xla_flags(devices: int = 1) -> str:
  """``XLA_FLAGS`` of a test process: ``devices`` host CPU devices, compiled for speed of compiling."""
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}"


def psd_power(c, power):
  """``C^power`` of a symmetric PSD matrix by eigendecomposition (negative eigenvalues clipped to 0)."""
  w, v = np.linalg.eigh(np.asarray(c, np.float64))
  w = np.clip(w, 0, None)
  return (v * w ** power) @ v.T


def orthonormal(rng, n, k):
  """An ``(n, k)`` matrix with orthonormal columns."""
  q, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return q


def newton_schulz(x, eps=1e-7):
  """Muon's quintic Newton-Schulz iteration by hand (optax's coefficients, 5 steps from x / (|x|_F + eps)), on the
  wide orientation."""
  wide = x.shape[0] <= x.shape[1]
  y = x if wide else x.T
  y = y / (np.linalg.norm(y) + eps)
  for _ in range(5):
    s = y @ y.T
    y = 3.4445 * y + (-4.7750 * s + 2.0315 * s @ s) @ y
  return y if wide else y.T


def im2col(x, window, stride=(1, 1), dilation=(1, 1), pads=((0, 0), (0, 0))):
  """Loop im2col of NHWC input: one row per output position, features in (kh, kw, cin) order."""
  (kh, kw), (sh, sw), (dh, dw) = window, stride, dilation
  xp = np.pad(np.asarray(x), [(0, 0), tuple(pads[0]), tuple(pads[1]), (0, 0)])
  b, h, w, _ = xp.shape
  oh = (h - (kh - 1) * dh - 1) // sh + 1
  ow = (w - (kw - 1) * dw - 1) // sw + 1
  rows = []
  for bi in range(b):
    for i in range(oh):
      for j in range(ow):
        rows.append(np.stack([xp[bi, i * sh + a * dh, j * sw + c * dw, :]
                              for a in range(kh) for c in range(kw)]).reshape(-1))
  return np.asarray(rows)


def smoke_config(dataset="mnist", **overrides):
  """configs/smoke.py for tfds mock data (no download), with top-level ``overrides``."""
  from configs import smoke

  config = smoke.get_config()
  config.dataset = dataset
  config.model = "lenet" if dataset == "mnist" else "svhn_net"
  config.download = False
  for key, value in overrides.items():
    config[key] = value
  return config


def final_params(workdir):
  """``(params, step)`` of the newest checkpoint of a run, read with the experiments' one reader."""
  state, step = final_state(workdir)
  return state["params"], step


def final_state(workdir, step=None):
  """``({"params", "opt_state"}, step)`` of the newest checkpoint of a smoke run (or of ``step``), read with the
  one reader."""
  import os

  from experiments.run import build
  from experiments.run import checkpoints

  ckpts = checkpoints.Checkpoints(os.path.join(workdir, "checkpoints"), os.path.join(workdir, "damaged"))
  abstract = build.abstract_state(build.build(smoke_config(), abstract=True))
  if step is None:
    step, restored, _ = ckpts.restore(abstract)
  else:
    restored, _ = ckpts._restore_one(step, abstract)
  ckpts.close()
  return restored, step


def state_differences(a_dir, b_dir, step):
  """Per leaf of two smoke runs' states at ``step``: ``(path, relative Frobenius difference, whether every
  element agrees to rtol 2e-4)``; a factor compared by the operator ``A^{-1}`` it applies (its basis is defined
  up to the sign of each column and a rotation within a near-degenerate eigenspace, which LAPACK picks from
  rounding-level differences such as the order of the devices' sums)."""
  import jax
  import numpy as np

  import scsgd_jax

  (a, sa), (b, sb) = final_state(str(a_dir), step), final_state(str(b_dir), step)
  assert sa == sb == step
  is_factor = lambda x: isinstance(x, scsgd_jax.sketch.Factor)
  out = []
  flat, _ = jax.tree_util.tree_flatten_with_path(a, is_leaf=is_factor)
  for (path, x), y in zip(flat, jax.tree.leaves(b, is_leaf=is_factor), strict=True):
    if is_factor(x):
      x, y = scsgd_jax.sketch.inverse_matrix(x), scsgd_jax.sketch.inverse_matrix(y)
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    close = np.allclose(x, y, rtol=2e-4, atol=2e-5 * max(1.0, float(np.abs(y).max(initial=0.0))))
    out.append((jax.tree_util.keystr(path), float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)), close))
  return out


def assert_same_training(a_dir, b_dir):
  """Two 40-step smoke runs on different device or process layouts trained as one. Their logged losses agree to
  1e-4 through step 20 and to 1e-2 through step 40, and at step 20 their parameters and the conditioning's
  statistics and factors agree to 1e-2 and the momentum to 1e-1 (relative Frobenius norm, per leaf). Past the
  first steps the smoke run's rates amplify rounding-level differences (the order of the devices' or the
  processes' sums): on MNIST the train loss agrees to 3e-6 at step 20 and 3e-3 at step 40, the momentum (a
  sum of recent gradients) to a few percent at step 20; a layout that trains on other rows or folds other
  statistics differs by far more from the first steps on."""
  import json
  import os

  for path, diff, _ in state_differences(a_dir, b_dir, 20):
    assert diff <= (1e-1 if ".trace[" in path else 1e-2), (path, diff)
  rows = [[json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))] for d in (a_dir, b_dir)]
  assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] and rows[0][-1]["step"] == 40
  for a, b in zip(*rows):
    for k in {"train_loss", "test_loss"} & a.keys():
      assert abs(a[k] - b[k]) <= (1e-4 if a["step"] <= 20 else 1e-2) * abs(b[k]), (k, a, b)


def adam_ratio_bound(b1, b2, t, nesterov=False):
  """The largest |m_hat| / sqrt(v_hat) Adam reaches at step t, from its weights by Cauchy-Schwarz, summed term by
  term: m_hat = sum_j w_j g_(t-j), v_hat = sum_j u_j g_(t-j)^2, bound sqrt(sum_j w_j^2 / u_j)."""
  j = np.arange(t, dtype=np.float64)
  u = (1 - b2) * b2 ** j / (1 - b2 ** t)
  if nesterov:  # NAdam: b1 m_t / (1 - b1^(t+1)) + (1 - b1) g_t / (1 - b1^t)
    w = b1 * (1 - b1) * b1 ** j / (1 - b1 ** (t + 1))
    w[0] += (1 - b1) / (1 - b1 ** t)
  else:
    w = (1 - b1) * b1 ** j / (1 - b1 ** t)
  return float(np.sqrt(np.sum(w ** 2 / u)))


def adam_ratio(m_hat, v_hat, eps, bound):
  """Adam's ratio m_hat / (sqrt(v_hat) + eps) in a rotated basis, clipped at its bound (where carried moments would
  pass it), each coordinate weighted by 1 / (1 + (f / v)^2) with f = 2^-30 its column's sum of v (a coordinate of
  round-off alone steps by nothing)."""
  f = 2.0**-30 * np.sum(v_hat, axis=-2, keepdims=True)
  weight = 1.0 / (1.0 + (f / np.maximum(v_hat, 1e-30)) ** 2)
  return np.clip(m_hat / (np.sqrt(v_hat) + eps), -bound, bound) * weight


def capped(x, limit):
  """x scaled down to Frobenius norm limit where it is longer."""
  norm = np.linalg.norm(x)
  return x if norm <= limit else x * (limit / norm)


def kernel_lines(summary: dict) -> dict:
  """A plans summary less its vectors' lines (biases, norms' scales: plain in every plan)."""
  return {p: why for p, why in summary.items() if not why.startswith("not conditioned: a bias")}
