"""walrus: a fast Walrus-style space-time transformer for PDE dynamics."""

__version__ = "0.1.0"
