"""demonet: decentralized training with DeMo (decoupled momentum optimization)."""

__version__ = "0.1.0"
