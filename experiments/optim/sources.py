"""Where each optimizer's recipe comes from: the citation a head-to-head row records as its source
(:mod:`registry` composes them per model kind)."""

PAPER = ("Gonen & Shalev-Shwartz, Section 3 (the paper's baseline; Caffe's LeNet solver): Nesterov SGD, "
         "momentum 0.9 (configs/default.py), rate 0.01")
SCSGD = "scsgd_jax's defaults (none changed for the benchmark); the paper's rate 0.01"
ADAM = ("Kingma & Ba (2015): Adam's lr 1e-3 and betas (0.9, 0.999); Loshchilov & Hutter (2019) decoupled "
        "weight decay at optax.adamw's default 1e-4 (image classifiers and linear models)")
NANOGPT = ("nanoGPT (Karpathy), config/train_shakespeare_char.py, the same character-level task: AdamW lr 1e-3 "
           "('with baby networks can afford to go a bit higher'), beta2 0.99 ('the number of tokens per iter "
           "is small'), weight decay 0.1 (train.py) on matrices and embeddings only (model.configure_optimizers); "
           "warmup then cosine decay")
NADAM = "Dozat (2016) / optax.nadamw: Adam's rate and betas with Nesterov momentum; weight decay as AdamW's"
MUON = ("Jordan et al. (2024), 'Muon: An optimizer for hidden layers in neural networks' "
        "(kellerjordan.github.io/posts/muon): lr 0.02, momentum 0.95, Nesterov, 5 Newton-Schulz steps "
        "(optax.contrib.muon's defaults) on hidden weight matrices, conv filters flattened as in the CIFAR-10 "
        "speedruns; 'the input embedding, final output layer, and any internal gains or biases should be "
        "optimized using a standard method such as AdamW': here AdamW with AdamW's own tuned rate and betas")
SHAMPOO = ("Anil et al. (2020), distributed Shampoo; its authors' language-model settings (Lingvo/Praxis "
           "DistributedShampoo.HParamsLanguageModeling): beta1 0.9, beta2 0.999, block 1536, matrix_epsilon "
           "1e-8, RMSPROP_NORMALIZED grafting (Adam-like per-layer step sizes), nesterov off, "
           "moving_average_for_momentum, exponent_override 0 (two-sided: inverse 4th roots of both factors), "
           "start_preconditioning_step 51 (after its first refresh period), preconditioning_compute_steps 50; "
           "the grafted step takes an Adam-scale rate (centre 1e-3)")
SKETCHY = ("Feinberg et al. (2023), Sketchy: Shampoo's statistics sketched by frequent directions "
           "(precondition-opt's implementation, input side at rank 32, which upstream requires to refresh every "
           "step), with Shampoo's settings and grafting above")
KFAC = ("kfac-jax (Botev & Martens): its optax interface (OptaxPreconditioner) chained with Nesterov SGD 0.9; "
        "no default rate or damping upstream, so damping is tuned jointly with the rate "
        "(benchmark.joint_grid); KL-clipping norm_constraint 1e-3 (FermiNet's kfac-jax setting); "
        "curvature_ema 0.95 and inverse_update_period 5 (upstream's defaults); conv layers' input factors by "
        "upstream's patches_moments_explicit, 'the exact same functionality' as its default 4-D convolution loop "
        "(14x faster on LeNet's second conv here: 68 vs 963 ms)")
PSGD = ("Li (2018, 2024), PSGD Kron, as psgd-jax 0.2.9 (Evan Walters) runs it: its README, 'Learning rate and "
        "weight decay act similarly to adam's, start with adam-like settings and go from there. Maybe use slightly "
        "lower learning rate (like /2)': rate centre half AdamW's, AdamW's weight decay (and nanoGPT's mask on a "
        "transformer), upstream's defaults otherwise (b1 0.9, preconditioner updated with probability 1 for 500 "
        "steps, then annealed to 0.03)")
DEVELOPED = ("rate centre 3.16e-4, chosen on the development task (experiments/results/develop/, synthetic data; "
             "its grid centred on Adam's 1e-3), frozen before any benchmark task ran it")
