"""scsgd-jax: Faster SGD Using Sketched Conditioning (Gonen & Shalev-Shwartz, 2015) for JAX, Optax and Flax."""

from scsgd_jax._src.alias import scsgd as scsgd
from scsgd_jax._src.capture import CapturedInputs as CapturedInputs
from scsgd_jax._src.capture import LayerInput as LayerInput
from scsgd_jax._src.capture import apply_gradients as apply_gradients
from scsgd_jax._src.capture import capture_linen as capture_linen
from scsgd_jax._src.capture import capture_nnx as capture_nnx
from scsgd_jax._src.capture import input_axes_linen as input_axes_linen
from scsgd_jax._src.capture import input_axes_nnx as input_axes_nnx
from scsgd_jax._src.capture import layer_rows as layer_rows
from scsgd_jax._src.graft import GraftState as GraftState
from scsgd_jax._src.graft import scale_by_grafting as scale_by_grafting
from scsgd_jax._src.graft import scale_by_normalized_rms as scale_by_normalized_rms
from scsgd_jax._src.patches import conv_patch_rows as conv_patch_rows
from scsgd_jax._src.patches import dense_rows as dense_rows
from scsgd_jax._src.sketch import BoundTerms as BoundTerms
from scsgd_jax._src.sketch import Factor as Factor
from scsgd_jax._src.sketch import apply_inverse as apply_inverse
from scsgd_jax._src.sketch import bound_terms as bound_terms
from scsgd_jax._src.sketch import conditioner_matrix as conditioner_matrix
from scsgd_jax._src.sketch import dense_factor as dense_factor
from scsgd_jax._src.sketch import diagonal_factor as diagonal_factor
from scsgd_jax._src.sketch import full_factor as full_factor
from scsgd_jax._src.sketch import identity_factor as identity_factor
from scsgd_jax._src.sketch import inverse_matrix as inverse_matrix
from scsgd_jax._src.sketch import low_rank_factor as low_rank_factor
from scsgd_jax._src.sketch import nystrom_factor as nystrom_factor
from scsgd_jax._src.sketch import precondition_kernel as precondition_kernel
from scsgd_jax._src.sketch import sketched_factor as sketched_factor
from scsgd_jax._src.sketch import sketched_factor_from_data as sketched_factor_from_data
from scsgd_jax._src.statistics import CorrelationStatistics as CorrelationStatistics
from scsgd_jax._src.statistics import EmaState as EmaState
from scsgd_jax._src.statistics import diagonal_correlation as diagonal_correlation
from scsgd_jax._src.statistics import ema_correlation as ema_correlation
from scsgd_jax._src.statistics import nystrom_correlation as nystrom_correlation
from scsgd_jax._src.plan import KernelPlan as KernelPlan
from scsgd_jax._src.plan import default_input_axes as default_input_axes
from scsgd_jax._src.plan import default_kernel_filter as default_kernel_filter
from scsgd_jax._src.transform import STATIC_ARGS as STATIC_ARGS
from scsgd_jax._src.transform import ScaleBySketchedConditioningState as ScaleBySketchedConditioningState
from scsgd_jax._src.transform import resolve_static_args as resolve_static_args
from scsgd_jax._src.transform import scale_by_sketched_conditioning as scale_by_sketched_conditioning

__version__ = "0.2.0.dev0"
