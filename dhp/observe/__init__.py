"""Observability: model FLOPs and MFU (``flops``), the step timeline (``trace``), TensorBoard scalars
(``tensorboard``) and plots of a run (``report``). Generic: nothing here imports a model family."""
