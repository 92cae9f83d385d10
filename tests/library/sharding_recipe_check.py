"""Run by test_robustness.py in its own process with 8 host CPU devices: Flax's SPMD recipe for every alias.

Kernels annotated ``nnx.with_partitioning(init, (None, "model"))`` on a (data 2, model 4) mesh; the model's and the
``nnx.Optimizer``'s state constrained by ``nnx.get_partition_spec`` inside ``nnx.jit`` (Flax's guide); 6 sharded
steps, against the same steps on one device (taken on the optax path, which ``nnx.Optimizer`` steps as). Then the
optax path with the state placed by ``scsgd_jax.state_shardings``, kernels sharded on their input axis (FSDP) or
output axis (tensor parallel). Prints one JSON line: per alias, the largest parameter difference (and the placed
statistics' specs).
"""

import json
import os

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optax.contrib  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import scsgd_jax as sk  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(16, 32, kernel_init=init, rngs=rngs)
    self.l2 = nnx.Linear(32, 32, kernel_init=init, rngs=rngs)
    self.head = nnx.Linear(32, 8, kernel_init=init, rngs=rngs)

  def __call__(self, x):
    return self.head(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


def aliases(model):
  axes = sk.input_axes_nnx(model)
  return {
      "scsgd":
          sk.scsgd(0.01, sk.Conditioning(input_axes=axes, refresh=sk.Refresh(every=2))),
      "scsgd_eigen":
          sk.scsgd_eigen(1e-3, sk.Conditioning(input_axes=axes, refresh=sk.Refresh(every=2))),
      "scsgd_eigen_muon":
          sk.scsgd_eigen_muon(0.02, sk.Conditioning(input_axes=axes, refresh=sk.Refresh(every=2)), output_layer="head"),
      "scsgd_two_sided":
          sk.contrib.scsgd_two_sided(1e-3, sk.Conditioning(input_axes=axes, refresh=sk.Refresh(every=2))),
      "conditioning_adamw":
          optax.chain(sk.scale_by_sketched_conditioning(sk.Conditioning(input_axes=axes, refresh=sk.Refresh(every=2))),
                      optax.adamw(1e-3)),
  }


def build(name, mesh):
  @nnx.jit
  def create():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, aliases(model)[name], wrt=nnx.Param)
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model, optimizer

  with jax.set_mesh(mesh):
    return create()


@nnx.jit(static_argnums=(4,))
def step(model, optimizer, x, y, two_sided):
  def loss_fn(model, perturbations):
    logits, inputs = sk.capture_nnx(model, x, max_rows=None, output_perturbations=perturbations)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), inputs

  perturbations = sk.contrib.output_perturbations_nnx(model, x) if two_sided else None
  (loss, inputs), (grads, deltas) = nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(model, perturbations)
  optimizer.update(model, grads, layer_inputs=inputs, **({"output_grads": deltas} if two_sided else {}))
  return loss


def run(name, mesh):
  model, optimizer = build(name, mesh)
  rng = np.random.default_rng(0)
  for _ in range(6):
    x, y = jnp.asarray(rng.standard_normal((16, 16)), jnp.float32), jnp.asarray(rng.integers(0, 8, 16))
    x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    with jax.set_mesh(mesh):
      step(model, optimizer, x, y, name == "scsgd_two_sided")
  return model


def run_placed(name, mesh, kernel_spec):
  """The optax path with the state placed by ``scsgd_jax.state_shardings``: 6 jitted steps whose outputs keep the
  parameters' and the state's shardings; the parameters, and each kernel statistic's spec."""
  with jax.set_mesh(mesh):  # the kernels' annotations need a mesh; the placement below is the rule's own
    model = MLP(nnx.Rngs(0))
  tx = aliases(model)[name]
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(params)
  ps = jax.tree.map(lambda leaf: NamedSharding(mesh, kernel_spec if leaf.ndim == 2 else P()), params)
  ss = sk.state_shardings(tx, params, ps)
  params = jax.device_put(params, ps)
  state = jax.jit(tx.init, out_shardings=ss)(params)
  two_sided = name == "scsgd_two_sided"

  def step(params, state, x, y):
    def loss_fn(params, perturbations):
      logits, inputs = sk.capture_nnx(nnx.merge(graphdef, nnx.State(params)), x, max_rows=None,
                                      output_perturbations=perturbations)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), inputs

    perturbations = (sk.contrib.output_perturbations_nnx(nnx.merge(graphdef, nnx.State(params)), x)
                     if two_sided else None)
    (_, inputs), (grads, deltas) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, perturbations)
    updates, state = tx.update(grads, state, params, layer_inputs=inputs,
                               **({"output_grads": deltas} if two_sided else {}))
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, out_shardings=(ps, ss))
  rng = np.random.default_rng(0)
  for _ in range(6):
    x, y = jnp.asarray(rng.standard_normal((16, 16)), jnp.float32), jnp.asarray(rng.integers(0, 8, 16))
    params, state = step(params, state, x, y)
  return params, _l2_statistics_specs(state)


def _l2_statistics_specs(state) -> dict[str, str]:
  """The shardings of l2's matrices of statistics in every conditioning state (each side's): its bank's leaves."""
  found = lambda x: isinstance(x, sk.ScaleBySketchedConditioningState)
  specs = {}
  for where, node in jax.tree_util.tree_leaves_with_path(state, is_leaf=found):
    if found(node) and "l2/kernel" in node.statistics:
      bank = node.statistics.banks[node.statistics.index.place("l2/kernel")[0]]
      for p, leaf in jax.tree_util.tree_leaves_with_path(bank):
        if leaf.ndim == 3:  # a bank of (n, l) sketches or (n, n) matrices
          specs[jax.tree_util.keystr(where) + jax.tree_util.keystr(p)] = str(leaf.sharding.spec)
  return specs


def main():
  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
  one = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"), axis_types=auto)
  out, placed = {}, {}
  names = ("scsgd", "scsgd_eigen", "scsgd_eigen_muon", "scsgd_two_sided", "conditioning_adamw")
  # one device's run, the reference of every sharded one: on one device every layout is the same, and Flax's
  # nnx.Optimizer steps as the optax path does
  singles = {name: run_placed(name, one, P())[0] for name in names}
  for name in names:
    sharded = run(name, mesh)
    kernel = sharded.l1.kernel[...]
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
               zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state(sharded, nnx.Param))), jax.tree.leaves(singles[name])))
    out[name] = {"difference": diff, "kernel_spec": str(kernel.sharding.spec)}
  for layout, spec in (("fsdp", P("model", None)), ("tensor_parallel", P(None, "model"))):
    placed[layout] = {}
    for name in names:
      (sharded, specs), single = run_placed(name, mesh, spec), singles[name]
      diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                 for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)))
      placed[layout][name] = {"difference": diff, "statistics_specs": specs}
  print(json.dumps({"devices": jax.device_count(), "aliases": out, "state_shardings": placed}))


if __name__ == "__main__":
  main()
