"""dhp: disaggregated hybrid parallelism for multimodal training on Ray."""

__version__ = "0.1.0"
