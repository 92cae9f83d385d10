"""The experimental tier's modules (:mod:`scsgd_jax.contrib`): the core never imports them."""
