"""ppgd_tpu: rank-1 parameter decomposition of frozen networks (SPEC.md)."""

__version__ = "0.1.0"
