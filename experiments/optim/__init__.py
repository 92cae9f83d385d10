"""The optimizers: the registry of every optimizer with its authors' recipe, the config to optax bridge, the peers and their patches, and the flat names of the library's options."""
