"""Reference implementations shared by the tests: dense oracles written the slow, obvious way."""

import numpy as np


def psd_power(c, power):
  """``C^power`` of a symmetric PSD matrix by eigendecomposition (negative eigenvalues clipped to 0)."""
  w, v = np.linalg.eigh(np.asarray(c, np.float64))
  w = np.clip(w, 0, None)
  return (v * w ** power) @ v.T


def orthonormal(rng, n, k):
  """An ``(n, k)`` matrix with orthonormal columns."""
  q, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return q


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


def final_state(workdir):
  """``({"params", "opt_state"}, step)`` of the newest checkpoint of a smoke run, read with the one reader."""
  import os

  from experiments import build
  from experiments import checkpoints

  ckpts = checkpoints.Checkpoints(os.path.join(workdir, "checkpoints"), os.path.join(workdir, "damaged"))
  step, restored, _ = ckpts.restore(build.abstract_state(build.build(smoke_config(), abstract=True)))
  ckpts.close()
  return restored, step
