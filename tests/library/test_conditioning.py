"""The conditioning's settings as one object: checked where it is built, read by every alias alike, and built from
the flat names command-line configs keep."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

import scsgd_jax as sk

PARAMS = {"dense": {"kernel": jnp.zeros((6, 3)), "bias": jnp.zeros(3)}}


def test_the_object_is_frozen_and_checked_where_it_is_built():
  c = sk.Conditioning(rank=4)
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.rank = 8
  assert c.replace(rank=8).rank == 8 and c.rank == 4
  with pytest.raises(ValueError, match=r"^Conditioning.rank must be an int >= 1, got 0"):
    sk.Conditioning(rank=0)
  with pytest.raises(TypeError, match=r"^Conditioning.kernel_filter must be a callable"):
    sk.Conditioning(kernel_filter="kernel")
  with pytest.raises(TypeError, match=r"^Conditioning.seed must be an int"):
    sk.Conditioning(seed=1.5)
  with pytest.raises(ValueError, match=r"Conditioner\(kind='full'\) needs the dense C"):
    sk.Conditioning(statistics=sk.Statistics(kind="streaming"), conditioner=sk.Conditioner(kind="full"))
  # a bare CorrelationStatistics is held as the Statistics of that kind
  custom = sk.sketch.ema_correlation(0.5)
  assert sk.Conditioning(statistics=custom).statistics == sk.Statistics(kind=custom)
  assert sk.Conditioning().sketch_rank() == 32 and sk.Conditioning(rank=5).sketch_rank() == 5


def test_from_flat_reads_every_flat_name_into_its_option():
  flat = dict(rank=8, ema_rate=0.2, statistics_every=1, outlier_threshold=50.0, oversample=4, power_iterations=2,
              budget="kernel", update_every=10, stagger=False, warm_start=False, full_max_dim=64,
              eigenvalue_floor=0.1, normalize="all", statistics="auto", conditioner="auto", seed=3)
  c = sk.Conditioning.from_flat(**flat)
  assert sorted(set(flat) - {"rank", "seed"}) == sorted(sk.Conditioning.FLAT_NAMES)
  assert c == sk.Conditioning(
      rank=8, seed=3,
      statistics=sk.Statistics(kind="auto", ema_rate=0.2, fold_every=1, outlier_threshold=50.0, oversample=4,
                               power_iterations=2, budget="kernel"),
      refresh=sk.Refresh(every=10, stagger=False, warm_start=False),
      conditioner=sk.Conditioner(kind="auto", full_max_dim=64, eigenvalue_floor=0.1, normalize="all"))
  assert sk.Conditioning.from_flat(statistics=sk.Statistics(kind="diagonal")).statistics.kind == "diagonal"


def test_from_flat_refuses_an_unknown_name_and_a_field_beside_its_option_object():
  with pytest.raises(TypeError, match=re.escape("not ['momentum']")):
    sk.Conditioning.from_flat(momentum=0.9)
  with pytest.raises(TypeError, match=r"statistics= as an option object and ema_rate= beside it: set ema_rate= on"):
    sk.Conditioning.from_flat(statistics=sk.Statistics(), ema_rate=0.1)


@pytest.mark.parametrize("build", [
    lambda c: sk.scsgd(0.1, c), lambda c: sk.scsgd_eigen(1e-3, c), lambda c: sk.scsgd_eigen_muon(0.02, c),
    lambda c: sk.scale_by_sketched_conditioning(c), lambda c: sk.scale_by_eigenbasis_adam(c),
    lambda c: sk.contrib.scsgd_two_sided(1e-3, c)], ids=["scsgd", "eigen", "eigen_muon", "transform",
                                                         "eigen_transform", "two_sided"])
def test_every_alias_reads_the_rank_and_the_seed_from_the_object(build):
  """The rank reaches the plans and the seed the state's key, under every alias alike."""
  c = sk.Conditioning(rank=2, statistics=sk.Statistics(kind="streaming"), seed=7)
  state = build(c).init(PARAMS)
  summary = sk.plans(state)
  assert summary["dense/kernel"].startswith("streaming C Omega, rank 2"), summary
  found = []

  def walk(x):
    if isinstance(x, sk.ScaleBySketchedConditioningState):
      found.append(x)
    elif isinstance(x, (tuple, list)):
      for y in x:
        walk(y)

  walk(state)
  want = sk.scale_by_sketched_conditioning(c).init(PARAMS).key
  np.testing.assert_array_equal(found[0].key, want)
