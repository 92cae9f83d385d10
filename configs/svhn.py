"""SVHN (cropped digits) / the paper's small SVHN net, Figures 3-4."""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = "svhn_cropped"
  config.model = "svhn_net"
  return config
