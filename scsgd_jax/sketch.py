"""The pure sketching functions (no state, no optax) and the correlation statistics: Algorithm 1's factors of
``A = Q B Q^T + a (I - Q Q^T)`` and their products, the full ``C^{1/2}``, the bound terms of the paper's analysis,
the rows a layer's inputs give (im2col patches for a conv), and the statistics objects ``statistics=`` takes, and the eigenbasis' moments."""

from scsgd_jax._src.eigen_math import EigenMoments as EigenMoments
from scsgd_jax._src.eigen_math import eigenbasis as eigenbasis
from scsgd_jax._src.patches import conv_patch_rows as conv_patch_rows
from scsgd_jax._src.patches import dense_rows as dense_rows
from scsgd_jax._src.layout import default_input_axes as default_input_axes
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

__all__ = sorted([
    "BoundTerms",
    "CorrelationStatistics",
    "EigenMoments",
    "EmaState",
    "Factor",
    "apply_inverse",
    "bound_terms",
    "conditioner_matrix",
    "conv_patch_rows",
    "default_input_axes",
    "dense_factor",
    "dense_rows",
    "diagonal_correlation",
    "diagonal_factor",
    "eigenbasis",
    "ema_correlation",
    "full_factor",
    "identity_factor",
    "inverse_matrix",
    "low_rank_factor",
    "nystrom_correlation",
    "nystrom_factor",
    "precondition_kernel",
    "sketched_factor",
    "sketched_factor_from_data",
])
